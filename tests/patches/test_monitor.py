"""``patches/monitor.py``: every ``steps_per_print`` steps DeepSpeed's monitors get XLA's counters, host numbers."""
import json
import os
from pathlib import Path

import numpy
import pytest

from deepspeed_xla.patches.monitor import xla_counters_every_print
from tests.launched.features_ranks import MONITORED, end_monitor_runs, offline_monitors
from tests.launched.test_features import MONITOR_READERS, csv_events, events, tensorboard_events
from tests.multiproc import within

OUT_ENV = "DSX_TEST_MONITOR_OUT"
STEPS, EVERY, BATCH, WIDTH = 6, 2, 4, 8
COUNTERS = ("xla_compilations", "xla_compile_seconds", "xla_executions", "xla_transfers_to_host",
            "xla_transfer_to_host_bytes")
#: Per step, these must not change when the monitors are on: reading the counters transfers and executes nothing.
PER_STEP = ("xla_executions", "xla_transfers_to_host", "xla_transfer_to_host_bytes")


def torch_xla_metrics() -> dict:
    """The reference: torch_xla's own metrics, read here as a training script reads them, once its device is idle."""
    import resource

    import psutil
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    xm.wait_device_ops()

    def data(name):
        return met.metric_data(name) or (0, 0.0, [])

    return {"xla_compilations": data("CompileTime")[0], "xla_compile_seconds": data("CompileTime")[1] / 1e9,
            "xla_executions": data("ExecuteTime")[0], "xla_transfers_to_host": data("TransferFromDeviceTime")[0],
            "xla_transfer_to_host_bytes": int(data("InboundData")[1]),
            # the kernel's high-water mark lags the resident size by some pages: the peak is at least what is in use
            "peak_rss": max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                            psutil.Process().memory_info().rss)}


def train(case: str) -> dict:
    """A two-layer MLP for ``STEPS`` steps, reading the loss on the host before each optimizer step (one transfer),
    with DeepSpeed's four monitors on (``case == "on"``; wandb and comet offline) or none; torch_xla's metrics before
    and after each step."""
    import deepspeed
    import torch
    folder = Path(os.environ[OUT_ENV]).parent / case
    monitors = json.loads(json.dumps({key: MONITORED[key] for key in MONITOR_READERS}).replace("MONITOR", str(folder)))
    if case == "on":
        offline_monitors(folder)
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "steps_per_print": EVERY, **(monitors if case == "on" else {})}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(), torch.nn.Linear(2 * WIDTH, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    steps = []
    for step in range(STEPS):
        before = torch_xla_metrics()
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), x.sum(1, keepdim=True).to(engine.device))
        engine.backward(loss)
        loss.item()
        engine.step()
        steps.append({"samples": engine.global_samples, "before": before, "after": torch_xla_metrics()})
    if case == "on":
        end_monitor_runs(engine)
    engine.destroy()
    return {"steps": steps, "folder": str(folder)}


def monitored_rank() -> None:
    from tests.multiproc import record_cases
    record_cases(["on", "off"], train, OUT_ENV)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    from tests.multiproc import run_rank_records
    (found, ) = run_rank_records(f"{__name__}:monitored_rank", "xla", 1, tmp_path_factory.mktemp("monitor") / "out",
                                 OUT_ENV)
    for case in ("off", "on"):
        assert "failed" not in found[case], found[case].get("failed")
    return found


def _written(record: dict, read) -> dict:
    return events(read(Path(record["on"]["folder"])))


def test_csv_and_tensorboard_hold_torch_xlas_metrics_at_each_printed_step(record):
    """Every ``steps_per_print`` steps, each counter's value in the CSV file equals torch_xla's metric read by the
    script right after that step (TensorBoard: as float32), at DeepSpeed's x, the global samples of its own ``lr``
    events. The process's memory is the host's (PJRT CPU): its in-use figure under its peak, and its peak between
    the process's peak before the step and after it."""
    printed = [step for step in record["on"]["steps"] if step["samples"] % (EVERY * BATCH) == 0]
    assert [step["samples"] for step in printed] == [EVERY * BATCH * n for n in range(1, STEPS // EVERY + 1)]
    csv, board = _written(record, csv_events), _written(record, tensorboard_events)
    for name in COUNTERS:
        expected = [[step["samples"], step["after"][name]] for step in printed]
        assert csv[f"Train_Samples_{name}"] == expected, name
        assert board[f"Train_Samples_{name}"] == [[x, float(numpy.float32(value))] for x, value in expected], name
    assert {x for x, _ in csv["Train_Samples_lr"]} >= {step["samples"] for step in printed}
    assert not any("xla_device_memory" in name for name in csv)
    for step, (_, in_use), (_, peak) in zip(printed, csv["Train_Samples_host_memory_in_use_bytes"],
                                            csv["Train_Samples_host_memory_peak_bytes"]):
        assert 0 < in_use <= peak and step["before"]["peak_rss"] <= peak <= step["after"]["peak_rss"]


def test_monitors_add_no_execution_or_transfer_to_a_step(record):
    """The same steps of the same model, monitors off and on: each step executes and transfers the same. The run's
    counters rise (a loss read each step), so an added read or graph would show."""

    def per_step(case):
        return [{name: step["after"][name] - step["before"][name] for name in PER_STEP}
                for step in record[case]["steps"]]

    assert per_step("on") == per_step("off")
    assert all(step["xla_transfers_to_host"] >= 1 and step["xla_executions"] >= 1 for step in per_step("on"))


def test_other_ranks_and_unmonitored_runs_write_nothing():
    """Rank 1, or no monitor enabled, or a step between two prints: no event and no wait for the device."""
    from types import SimpleNamespace
    written = []

    def engine(rank: int, enabled: bool, steps: int):
        return SimpleNamespace(steps_per_print=lambda: EVERY, global_rank=rank, global_steps=steps, global_samples=0,
                               monitor=SimpleNamespace(enabled=enabled, write_events=written.append))

    take_model_step = xla_counters_every_print(lambda self: "stepped")
    for args in ((1, True, EVERY), (0, False, EVERY), (0, True, EVERY + 1)):
        assert take_model_step(engine(*args)) == "stepped"
    assert written == []


def test_wandb_and_comet_hold_what_the_csv_holds(record):
    """The four monitors get the counters from one ``write_events`` call, as they get DeepSpeed's own events: wandb's
    offline run and comet's offline archive hold the CSV's XLA events (comet: as float32)."""
    folder = Path(record["on"]["folder"])
    logged = {name: points for name, points in events(csv_events(folder)).items() if "memory" in name or "xla_" in name}
    assert len(logged) == len(COUNTERS) + 2, logged
    for monitor in ("wandb", "comet"):
        held = events(MONITOR_READERS[monitor](folder))
        for name, points in logged.items():
            assert within(held[name], points, atol=0.0, rtol=1e-6), (monitor, name, held.get(name))
