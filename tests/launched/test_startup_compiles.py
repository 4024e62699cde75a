"""Start-up compilations do not grow with the model's tensor count: from ``deepspeed.initialize`` to the end of the
first step, ZeRO 0-3 (fp32 and bf16) compile as many graphs at 2 layers as at 8.

The model gives every parameter tensor a shape of its own (each layer one feature wider than the one before), so
anything DeepSpeed executes once per tensor is a graph XLA has not compiled yet: a model of repeated blocks would
hide it behind the compilation cache, while a real model's first start (or a TPU restart without a warm cache) pays
it per distinct shape. One process per depth trains every case in turn, the two running at once; each case counts
torch_xla's compilations around its ``deepspeed.initialize`` and first step.

``python -m tests.launched.test_startup_compiles 2 4 16`` prints the counts at those depths with DeepSpeed's own
``defragment`` and with ``patches/zero_startup.py``'s (docs/performance.md, 'Start-up compilations').
"""
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.multiproc import record_cases
from tests.multiproc.launching import run_forked_job

DEPTHS = (2, 8)
WIDTH, BATCH = 8, 4
OUT_ENV = "DSX_TEST_STARTUP_COMPILES_OUT"
CASES = [f"zero{stage}-{dtype}" for stage in range(4) for dtype in ("fp32", "bf16")]
# What a first step may compile whatever the depth: its step graph, ZeRO-3's move of the partitions into their flat
# buffer at initialize (one graph for all) and its first-step bookkeeping (the gathers' order, read once); the
# cases run in one process, so a later case's graph may come from an earlier case's cache.
MOST_COMPILATIONS = 4


def model(layers: int) -> torch.nn.Module:
    """Linear layers whose widths grow by one: no two parameter tensors share a shape."""
    widths = [WIDTH + i for i in range(layers + 1)]
    blocks = []
    for width_in, width_out in zip(widths, widths[1:]):
        blocks += [torch.nn.Linear(width_in, width_out), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks)


def config(case: str) -> dict:
    stage, dtype = int(case[4]), case.split("-")[1]
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}  # every one gathered
    return {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": zero, "bf16": {"enabled": dtype == "bf16"}, "steps_per_print": 1000}


def first_step(case: str, layers: int) -> dict:
    """The compilations (and executions) from ``deepspeed.initialize`` to the end of the first step."""
    import gc
    import deepspeed
    from deepspeed_xla import xla_runtime
    torch.manual_seed(0)
    net = model(layers)
    # An earlier case's engine, collected now and not inside this case's count: its __del__ destroys it again, and
    # its optimizer's destroy() synchronizes the device (a graph of whatever is pending).
    gc.collect()
    before = xla_runtime.graph_counters()
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config(case))
    features = torch.randn(BATCH, WIDTH).to(engine.device, engine.module[0].weight.dtype)
    loss = engine(features).float().square().mean()
    engine.backward(loss)
    engine.step()
    after = xla_runtime.graph_counters()
    engine.destroy()
    return {"tensors": len(list(net.parameters())), **{key: after[key] - before[key] for key in before}}


def rank_main() -> None:
    """One process (its depth in ``sys.argv``, then ``upstream`` for DeepSpeed's own ``defragment``): every case in
    turn."""
    import deepspeed
    deepspeed.init_distributed()
    layers, upstream = int(sys.argv[1]), sys.argv[2:] == ["upstream"]
    if upstream:
        import deepspeed.runtime.zero.stage3 as stage3
        stage3.defragment = stage3.defragment.__wrapped__
    record_cases(CASES, lambda case: first_step(case, layers), OUT_ENV)


def launch(layers: int, out: Path, upstream: bool = False) -> dict:
    run_forked_job("tests.launched.test_startup_compiles:rank_main", "xla", 1, {OUT_ENV: str(out)}, after_import=(OUT_ENV, ),
                   args=(layers, *(["upstream"] if upstream else [])))
    return json.loads(Path(f"{out}.rank0").read_text())


@pytest.fixture(scope="module")
def depths(tmp_path_factory) -> dict:
    """``{layers: record}``: the two depths' processes, run at once."""
    workdir = tmp_path_factory.mktemp("startup")
    with ThreadPoolExecutor(max_workers=len(DEPTHS)) as pool:
        jobs = {layers: pool.submit(launch, layers, workdir / f"layers{layers}") for layers in DEPTHS}
        return {layers: job.result() for layers, job in jobs.items()}


@pytest.mark.parametrize("case", CASES)
def test_first_step_compiles_the_same_at_every_depth(depths, case):
    shallow, deep = (depths[layers][case] for layers in DEPTHS)
    assert "failed" not in shallow and "failed" not in deep, shallow.get("failed") or deep.get("failed")
    assert deep["tensors"] == 4 * shallow["tensors"]
    assert deep["compilations"] == shallow["compilations"] <= MOST_COMPILATIONS, (shallow, deep)
    if not case.startswith("zero3"):  # ZeRO-3's __init__ formats every parameter into a log line: a read per tensor
        assert deep["transfers_to_host"] == shallow["transfers_to_host"] == 0, (shallow, deep)


def main(depths) -> None:
    """Print each case's compilations at each depth, upstream's and patched (one process at a time)."""
    workdir = Path(tempfile.mkdtemp(prefix="startup-compiles-"))
    runs = {(layers, upstream): launch(layers, workdir / f"{layers}-{upstream}", upstream)
            for layers in depths for upstream in (True, False)}
    print("| case | " + " | ".join(f"{layers} layers ({runs[layers, False][CASES[0]]['tensors']} tensors)"
                                    for layers in depths) + " |")
    print("|---|" + "---|" * len(depths))
    for case in CASES:
        print(f"| {case} | " + " | ".join(f"{runs[layers, True][case]['compilations']} -> "
                                         f"{runs[layers, False][case]['compilations']}" for layers in depths) + " |")


if __name__ == "__main__":
    main([int(arg) for arg in sys.argv[1:]] or [2, 4, 16])
