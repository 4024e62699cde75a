"""AutoTP on a data-parallel x tensor-parallel mesh (4 ranks, ``autotp_size`` 2: tensor-parallel groups {0, 1} and
{2, 3}, data-parallel groups {0, 2} and {1, 3}) against DeepSpeed's own CPU accelerator, as DeepSpeed's ``TestSave``
and ``TestTpGradNorm`` (tests/unit/model_parallelism/test_autotp_training.py) train it: linear layers made column- and
row-parallel by hand, a batch that requires grad (AutoTP's first forward broadcasts it within each tensor-parallel
group as an object), Adam with a warm-up schedule, then a checkpoint saved and loaded into a second engine.

One 4-rank launch per accelerator trains every case in turn: ZeRO 0-2 in fp32 and bf16. Each rank records its
per-step losses and gradient norms, its final weights, and how the loaded engine's weights and optimizer state
differ from the trained one's.
"""
import pytest
import torch

from tests.multiproc import LOSS_TOLERANCE, PARAM_TOLERANCE, record_cases, records_on_both_accelerators, within

WORLD, TP, STEPS, HIDDEN, LAYERS = 4, 2, 3, 16, 4
OUT_ENV = "DSX_TEST_AUTOTP_MESH_OUT"
CASES = [f"zero{stage}-{dtype}" for stage in (0, 1, 2) for dtype in ("float32", "bfloat16")]


def config(name: str) -> dict:
    stage, dtype = int(name[4]), name.partition("-")[2]
    skip_all = {"use_default_specs": False, "layer_specs": [{"patterns": [".*\\.weight$"], "partition_type": "skip"}]}
    return {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "bf16": {"enabled": dtype == "bfloat16"},
            "tensor_parallel": {"autotp_size": TP, "partition_config": skip_all},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                         "warmup_num_steps": 1000}}}


def tp_model(dtype: torch.dtype) -> torch.nn.Module:
    """DeepSpeed's ``prepare_tp_model``: a stack of linear layers, layer 1 column-parallel and layer 2 row-parallel
    over the rank's tensor-parallel group, the same weights on every rank before the split."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer
    from deepspeed.utils import groups

    class Stack(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.linears = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))

        def forward(self, x, y):
            for layer in self.linears:
                x = layer(x)
            return torch.nn.functional.cross_entropy(x.float(), y)

    torch.manual_seed(0)
    model = Stack().to(dtype)
    group = groups.get_tensor_model_parallel_group()
    model.linears[1] = LinearLayer(model.linears[1], group)
    model.linears[2] = LinearAllreduce(model.linears[2], group)
    return model


def state_of(engine) -> dict:
    """The engine's weights and its optimizer's state tensors, in order, as fp32 lists."""
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO and bf16 wrap the torch optimizer
    tensors = [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return {"params": [p.detach().float().cpu().flatten().tolist() for p in engine.module.parameters()],
            "optimizer": [t.detach().float().cpu().flatten().tolist() for t in tensors]}


def train(name: str) -> dict:
    import os

    import deepspeed
    from deepspeed.utils import groups
    dtype = torch.bfloat16 if name.endswith("bfloat16") else torch.float32
    model = tp_model(dtype)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(name))
    data = torch.Generator().manual_seed(1 + groups.get_data_parallel_rank())  # the same within a TP group
    losses, norms = [], []
    for _ in range(STEPS):
        x = torch.randn(1, HIDDEN, generator=data).to(dtype).to(engine.device)
        x.requires_grad = True
        loss = engine(x, torch.randint(0, HIDDEN, (1, ), generator=data).to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        norms.append(engine.get_global_grad_norm())
    folder = f"{os.environ[OUT_ENV]}.{name}"
    engine.save_checkpoint(folder)
    loaded_model = tp_model(dtype)
    loaded, *_ = deepspeed.initialize(model=loaded_model, model_parameters=loaded_model.parameters(),
                                      config=config(name))
    loaded.load_checkpoint(folder, load_optimizer_states=True, load_lr_scheduler_states=True)
    trained, restored = state_of(engine), state_of(loaded)
    same = restored == trained and loaded.lr_scheduler.state_dict() == engine.lr_scheduler.state_dict()
    loaded.destroy()
    engine.destroy()
    return {"losses": [float(loss) for loss in losses], "params": trained["params"], "loaded_as_saved": same,
            "norms": [None if norm is None else float(norm) for norm in norms]}


def rank_main() -> None:
    """One rank: every case in turn, on the groups a first engine makes (DeepSpeed's ``dummy_init_engine``: the
    layers need their tensor-parallel group before any engine of theirs exists)."""
    import deepspeed
    first = torch.nn.Linear(HIDDEN, HIDDEN)
    deepspeed.initialize(model=first, model_parameters=first.parameters(), config=config(CASES[0]))[0].destroy()
    record_cases(CASES, train, OUT_ENV)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(xla, cpu)``: each a list of per-rank records, the two launches run concurrently. Ranks that wait in
    different collectives (as the input check's failure left them) stop after 2 minutes naming where each waits."""
    return records_on_both_accelerators(f"{__name__}:rank_main", WORLD, tmp_path_factory.mktemp("autotp_mesh"),
                                        OUT_ENV, {"CPU_NUM_DEVICES": WORLD, "DS_XLA_COMM_TIMEOUT": 120})


@pytest.mark.parametrize("case", CASES)
def test_trains_saves_and_loads_like_cpu_accelerator(runs, case):
    dtype = case.partition("-")[2]
    for rank, (xla, cpu) in enumerate(zip(*runs, strict=True)):
        xla, cpu = xla[case], cpu[case]
        assert "failed" not in cpu, f"CPU accelerator, rank {rank}:\n{cpu['failed']}"
        assert "failed" not in xla, f"XLA, rank {rank}:\n{xla['failed']}"
        assert within(xla["losses"], cpu["losses"], **LOSS_TOLERANCE[dtype]), (rank, xla["losses"], cpu["losses"])
        if None in cpu["norms"]:  # ZeRO-0 in fp32 keeps no gradient norm
            assert xla["norms"] == cpu["norms"], rank
        else:
            assert within(xla["norms"], cpu["norms"], **LOSS_TOLERANCE[dtype]), (rank, xla["norms"], cpu["norms"])
        for mine, theirs in zip(xla["params"], cpu["params"], strict=True):
            assert within(mine, theirs, **PARAM_TOLERANCE[dtype]), rank
        assert xla["loaded_as_saved"] and cpu["loaded_as_saved"], rank


def test_the_mesh_is_data_times_tensor_parallel(runs):
    """Both tensor-parallel ranks of a group see the same loss, the two groups (their own data) another; each rank
    holds its own half of the column-parallel layer."""
    for ranks in runs:
        losses = [ranks[rank]["zero0-float32"]["losses"] for rank in range(WORLD)]
        assert losses[0] == losses[1] != losses[2] == losses[3]
        shards = [ranks[rank]["zero0-float32"]["params"][2] for rank in range(TP)]  # linears[1].weight
        assert len(shards[0]) == HIDDEN * HIDDEN // TP and shards[0] != shards[1]
