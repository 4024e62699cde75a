"""``patches/flops_profiler.py``: DeepSpeed's flops profiler times the device on XLA, not the compiler."""
import re

PROFILE_STEP = 5
STEPS = 8
PROFILER_OUT = "DSX_TEST_FLOPS_PROFILER_OUT"


def profiled_training(case: str) -> dict:
    """Two ranks, ZeRO-2, TinyGPT: ``STEPS`` steps with the profiler at ``PROFILE_STEP``; the compilations and
    executions of each step (XLA's counters; none on the CPU accelerator) and rank 0's printed profile."""
    import os
    import sys
    import deepspeed
    import warnings
    import torch
    from tests.conftest import REPO
    sys.path.insert(0, str(REPO / "scripts"))
    from train import TinyGPT, make_batch
    deepspeed.init_distributed()
    output = f"{os.environ[PROFILER_OUT]}.profile.txt"
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
              "flops_profiler": {"enabled": True, "profile_step": PROFILE_STEP, "output_file": output}}
    torch.manual_seed(0)
    model = TinyGPT(64, 64, 2, seq=16)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    xla = deepspeed.get_accelerator().device_name() == "xla"
    if xla:
        from deepspeed_xla import xla_runtime
    counts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            before = xla_runtime.graph_counters() if xla else None
            tokens, targets = make_batch(step, engine.global_rank, 4, 16, 64)
            engine.backward(engine(tokens.to(engine.device), targets.to(engine.device)))
            engine.step()
            if xla:
                after = xla_runtime.graph_counters()
                counts.append({key: after[key] - before[key] for key in ("compilations", "executions")})
    deepspeed.comm.barrier()
    return {"counts": counts, "profile": open(output).read() if engine.global_rank == 0 else None,
            "compile_warnings": [str(w.message) for w in caught if "compiled a new graph" in str(w.message)]}


def profiled_rank() -> None:
    from tests.multiproc import record_cases
    record_cases(["zero2"], profiled_training, PROFILER_OUT)


def _line(profile: str, name: str) -> str:
    return re.search(rf"^{re.escape(name)}:\s+(.*?)\s*$", profile, re.M).group(1)


def test_the_profiled_step_runs_graphs_compiled_before_it_and_its_latencies_are_the_devices(tmp_path):
    """The profiled step compiles nothing (the step before it ran the same three graphs: forward, backward and update,
    cut where the engine's timers wait for the device), on both ranks alike, and the steps after it run the whole step
    graph again. The profile's FLOP count is the CPU accelerator's; its latencies are positive; each module's latency
    reads as not measured (the CPU accelerator's are measured), never as a compile time. The timed steps' new graphs,
    after the warm-up, bring no recompilation warning: the profiler chose them, not the user's code."""
    from deepspeed_xla.patches.flops_profiler import NOTE, NOT_MEASURED
    from tests.multiproc import records_on_both_accelerators
    xla, cpu = records_on_both_accelerators(f"{__name__}:profiled_rank", 2, tmp_path, PROFILER_OUT,
                                            {"DS_XLA_WARMUP_STEPS": str(PROFILE_STEP - 2)})
    for rank in range(2):
        assert xla[rank]["zero2"]["compile_warnings"] == [], xla[rank]["zero2"]["compile_warnings"]
        counts = xla[rank]["zero2"]["counts"]
        warm, profiled, steady = counts[PROFILE_STEP - 1], counts[PROFILE_STEP], counts[PROFILE_STEP - 2]
        assert profiled["compilations"] == 0 and profiled["executions"] == warm["executions"], counts
        assert warm["executions"] > steady["executions"], counts  # the timed steps really are cut
        assert all(count == {"compilations": 0, "executions": steady["executions"]}
                   for count in counts[PROFILE_STEP + 1:]), counts
    assert xla[0]["zero2"]["counts"] == xla[1]["zero2"]["counts"]
    mine, theirs = xla[0]["zero2"]["profile"], cpu[0]["zero2"]["profile"]
    assert _line(mine, "fwd flops per GPU") == _line(theirs, "fwd flops per GPU")
    for name in ("fwd latency", "bwd latency", "step latency", "iter latency"):
        value, unit = _line(mine, name).split()
        assert float(value) > 0 and unit in ("ms", "s"), (name, mine)
    assert "% latency" in theirs and "% latency" not in mine and mine.count(NOT_MEASURED) > 5, mine
    assert NOTE in mine
