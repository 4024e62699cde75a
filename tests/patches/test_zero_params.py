"""``patches/zero_params.py``: with ZeRO-1/2's parameters owning their buffers on XLA, what upstream reads and writes
through its flat buffers outside a step (a load's ``update_lp_params``) still reaches the parameters. That the step
holds the weights once: tests/bench/test_cost.py::test_zero_1_and_2_hold_the_weights_once and test_tpu_compile.py."""
import json

from tests.multiproc import run_ranks

CASES = {"zero1-fp32": (1, False), "zero2-bf16": (2, True)}


def own_buffers_rank() -> None:
    """Run by ``run_ranks`` on 2 XLA ranks: each case in turn (``own_buffers_case``)."""
    import deepspeed
    deepspeed.init_distributed()
    print(json.dumps({case: own_buffers_case(*CASES[case]) for case in CASES}))


def own_buffers_case(stage: int, bf16: bool) -> dict:
    """An engine trained 2 steps, its fp32 partition halved and written back with ``update_lp_params``, then doubled
    and written back, then 2 steps more; and a fresh engine trained the same 4 steps without the writes."""
    import sys
    import deepspeed
    import torch
    from tests.conftest import REPO
    sys.path.insert(0, str(REPO / "scripts"))
    from train import TinyGPT, make_batch
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "bf16": {"enabled": bf16}}

    def engine_and_steps():
        torch.manual_seed(0)
        model = TinyGPT(64, 64, 2, seq=16)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def steps(first, count):
            losses = []
            for step in range(first, first + count):
                tokens, targets = make_batch(step, engine.global_rank, 4, 16, 64)
                loss = engine(tokens.to(engine.device), targets.to(engine.device))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            return losses

        return engine, steps

    engine, steps = engine_and_steps()
    optimizer, params = engine.optimizer, list(engine.module.parameters())
    record = {"losses": steps(0, 2),
              "flat_is_params": all(torch.equal(flat.cpu(), torch.cat(
                  [p.detach().reshape(-1) for p in group] + [flat.new_zeros(flat.numel() - sum(
                      p.numel() for p in group))]).cpu()) for flat, group in zip(
                          optimizer.bit16_groups_flat, optimizer.round_robin_bit16_groups))}
    before = [p.detach().cpu() for p in params]
    for partition in optimizer.single_partition_of_fp32_groups:
        partition.data.mul_(0.5)
    optimizer.update_lp_params()
    record["halved"] = all(torch.equal(p.detach().cpu(), old * 0.5) for p, old in zip(params, before))
    for partition in optimizer.single_partition_of_fp32_groups:
        partition.data.mul_(2.0)
    optimizer.update_lp_params()
    record["losses"] += steps(2, 2)
    engine.destroy()
    fresh, fresh_steps = engine_and_steps()
    record["reference"] = fresh_steps(0, 4)
    fresh.destroy()
    return record


def test_parameters_own_their_buffers_and_follow_every_write():
    """The flat buffer DeepSpeed reads is the parameters'; a halved fp32 partition written back by ``update_lp_params`` halves every parameter, and doubled back
    the training goes on as a fresh engine's; the two ranks' losses differ (their batches do)."""
    procs = run_ranks("tests.patches.test_zero_params:own_buffers_rank", 2, env={"DS_ACCELERATOR": "xla"})
    assert all(proc.returncode == 0 for proc in procs), [proc.stderr[-4000:] for proc in procs]
    ranks = [json.loads(proc.stdout.strip().splitlines()[-1]) for proc in procs]
    for case in CASES:
        for rank in ranks:
            assert rank[case]["flat_is_params"] and rank[case]["halved"], (case, rank[case])
            assert rank[case]["losses"] == rank[case]["reference"], (case, rank[case])
        assert ranks[0][case]["losses"] != ranks[1][case]["losses"], case
