"""``patches/zero3_hooks.py``: ZeRO-3's hooks do the same with less Python."""
import pytest
import torch

from deepspeed_xla import patches
from deepspeed_xla.patches import zero3_hooks


@pytest.fixture
def rank_queries(monkeypatch):
    """Counts ``deepspeed.comm.get_rank`` calls; this process is rank 0."""
    from deepspeed import comm
    calls = []
    monkeypatch.setattr(comm, "get_rank", lambda *args, **kwargs: calls.append(args) or 0)
    return calls


def test_print_rank_0_asks_for_the_rank_only_when_it_prints(rank_queries, capsys):
    """ZeRO-3's gathers and releases (partitioned_param_coordinator, parameter_offload: their ``import *`` takes the
    patched function) call print_rank_0 with ``force=False``: no rank query and nothing printed; forced, rank 0 prints
    as upstream does."""
    import deepspeed.runtime.zero.parameter_offload as offload
    import deepspeed.runtime.zero.partition_parameters as partition
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    (patch,) = [p for p in patches.PATCHES if p.wrapper is zero3_hooks.print_rank_0_when_asked]
    assert patches.is_applied(patch)
    assert coordinator.print_rank_0 is partition.print_rank_0 is offload.print_rank_0
    for print_rank_0 in (partition.print_rank_0, coordinator.print_rank_0):
        print_rank_0("released", force=False)
    assert rank_queries == [] and capsys.readouterr().out == ""
    partition.print_rank_0("forced", force=True)
    partition.print_rank_0("debug", debug=True)
    assert len(rank_queries) == 2 and capsys.readouterr().out == "forced\ndebug\n"
    upstream = partition.print_rank_0.__wrapped__  # upstream's asks every time
    upstream("released", force=False)
    assert len(rank_queries) == 3


def resumed_first_step():
    """Run by ``run_ranks``: a ZeRO-3 engine (DeepSpeed's default persistence threshold: every parameter of this
    model persistent) trains 2 steps, saves, trains 2 more; a new engine on a new model loads the checkpoint and
    trains those 2 steps again. Prints both runs' losses and the parameters each resumed step gathered."""
    import json
    import os
    import deepspeed
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator
    name = "_PartitionedParameterCoordinator__all_gather_params"
    upstream, gathered = getattr(Coordinator, name), []

    def all_gather_params(self, params, forward):
        gathered[-1] += len(params)
        return upstream(self, params, forward)

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}}}
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(0))
    losses = {"full": [], "resumed": []}

    def train(engine, run, steps):
        for _ in range(steps):
            gathered.append(0)
            loss = engine(x.to(engine.device)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses[run].append(loss.item())

    for run in ("full", "resumed"):
        torch.manual_seed(0 if run == "full" else 1)  # the resumed weights come from the checkpoint
        model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
        engine, *_ = deepspeed.initialize(model=model, config=config)
        if run == "full":
            train(engine, run, 2)
            engine.save_checkpoint(os.environ["CHECKPOINT_DIR"])
        else:
            engine.load_checkpoint(os.environ["CHECKPOINT_DIR"])
            gathered.clear()
            setattr(Coordinator, name, all_gather_params)
        train(engine, run, 2)
        engine.destroy()
    print(json.dumps({**losses, "gathered": gathered}))


def test_a_resumed_zero3_step_keeps_persistent_parameters_gathered(tmp_path):
    """#63: before its parameter order is recorded (a resumed job's first step), upstream releases persistent
    parameters after each module and gathers them again for the backward, so on XLA that step ran another graph than
    the uninterrupted job's (slices of gather buffers where the parameters were), rounded differently: the resumed
    losses drifted from the uninterrupted ones. Patched, the resumed steps gather no persistent parameter, as the
    recorded steps do, and repeat the uninterrupted losses exactly."""
    import json
    from tests.multiproc import run_ranks
    for proc in run_ranks("tests.patches.test_zero3_hooks:resumed_first_step", 2,
                          env={"DS_ACCELERATOR": "xla", "CHECKPOINT_DIR": str(tmp_path)}):
        assert proc.returncode == 0, proc.stderr[-6000:]
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        assert found["gathered"] == [0, 0]
        assert found["resumed"] == found["full"][2:]
