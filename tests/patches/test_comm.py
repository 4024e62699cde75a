"""``patches/comm.py``: the comms logger records each op's own latency."""
import types

import pytest
import torch

from deepspeed_xla import patches
from deepspeed_xla.patches import comm


@pytest.fixture
def logger(monkeypatch):
    """DeepSpeed's comms logger on, profiling every op, with an empty record; the timers' clock in our hands."""
    from deepspeed.comm import comm as ds_comm
    from deepspeed.utils import timer
    clock = [100.0]
    monkeypatch.setattr(timer.time, "time", lambda: clock[0])
    monkeypatch.setattr(ds_comm.comms_logger, "enabled", True)
    monkeypatch.setattr(ds_comm.comms_logger, "prof_all", True)
    monkeypatch.setattr(ds_comm.comms_logger, "verbose", False)
    monkeypatch.setattr(ds_comm.comms_logger, "comms_dict", {})
    # The backend timed_op and the logger's bandwidth figures ask: 2 ranks, no MPI.
    monkeypatch.setattr(ds_comm, "cdb", types.SimpleNamespace(using_mpi=False, is_initialized=lambda: True,
                                                               get_world_size=lambda group=None: 2))
    return ds_comm, clock


def test_each_logged_latency_is_the_ops_own(logger, monkeypatch):
    """An op decorated by DeepSpeed's own ``timed_op`` takes 10, 20 then 30 ms by the clock, each after work of 1 s
    the device has yet to do (the graph of its operands): the logger records 10, 20 and 30, not the running sums
    upstream's timers give (10, 30, 60), nor the pending work that ``timed_op``'s one wait, after the op, would put
    into it."""
    from deepspeed.accelerator import get_accelerator
    ds_comm, clock = logger
    (patch, ) = [p for p in patches.PATCHES if p.wrapper is comm.each_op_timed_alone]
    assert patches.is_applied(patch)
    pending = [0.0]

    def synchronize(device_index=None):
        clock[0] += pending[0]
        pending[0] = 0.0

    monkeypatch.setattr(get_accelerator(), "synchronize", synchronize)

    @ds_comm.timed_op
    def all_reduce(tensor, op=None, group=None, async_op=False, prof=False, log_name="all_reduce", debug=""):
        synchronize()  # an XLA collective computes its operands first
        clock[0] += durations.pop(0)

    durations = [0.010, 0.020, 0.030]
    for _ in range(3):
        pending[0] = 1.0
        all_reduce(torch.ones(256))
    ((size, (count, latencies, *_)), ) = ds_comm.comms_logger.comms_dict["all_reduce"].items()
    assert (size, count) == (1024, 3)
    assert latencies == pytest.approx([10.0, 20.0, 30.0])

    upstream = type(ds_comm.timers).__mro__[1]()  # what the logger read before the patch: the sums
    for duration in (0.010, 0.020):
        upstream("op").start()
        clock[0] += duration
        upstream("op").stop()
        last = upstream("op").elapsed(reset=False)
    assert last == pytest.approx(30.0)


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "computed"])
def test_an_xla_tensor_that_requires_grad_unpickles(xla_device, leaf):
    """What AutoTP's input check does with a batch that requires grad (``broadcast_object_list`` pickles it): the tensor
    comes back on the device, equal, requiring grad and a leaf. Upstream's rebuild, handed the same pickled copy,
    raises."""
    import inspect
    import pickle
    (patch, ) = [p for p in patches.PATCHES if p.wrapper is comm.rebuilt_xla_tensor_is_a_leaf]
    assert patches.is_applied(patch)
    source = torch.arange(6.0, device=xla_device).requires_grad_()
    sent = source if leaf else source * 2
    received = pickle.loads(pickle.dumps(sent))
    assert received.device == sent.device and received.is_leaf and received.requires_grad
    assert torch.equal(received.detach().cpu(), sent.detach().cpu())
    rebuild, args = sent.__reduce_ex__(2)
    with pytest.raises(RuntimeError, match="leaf variables"):
        inspect.unwrap(rebuild)(*args)


LOGGER_OUT = "DSX_TEST_COMMS_LOGGER_OUT"
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
NUMELS = (1 << 19, 1 << 21)  # each collective's input: 2 MB and 8 MB of fp32
ROUNDS, WARMUP = 60, 4


def _collective(name: str, numel: int, world: int, device):
    """``(operands, run)``: fresh operands for the collective ``name`` over an input of ``numel`` elements, each left
    for the device to compute behind a chain of matmuls (as a backward leaves a gradient bucket to ZeRO's reduce)."""
    import deepspeed.comm as dist
    import torch
    weight = torch.full((192, 192), 1.0 / 192, device=device)
    out = torch.empty(numel * world if name == "all_gather_into_tensor" else numel // world, device=device)

    def operands():
        chain = weight
        for _ in range(6):
            chain = torch.tanh(chain @ weight)
        return torch.ones(numel, device=device) + chain.mean()

    run = {"all_reduce": lambda x: dist.all_reduce(x),
           "all_gather_into_tensor": lambda x: dist.all_gather_into_tensor(out, x),
           "reduce_scatter_tensor": lambda x: dist.reduce_scatter_tensor(out, x)}[name]
    return operands, run


def logged_and_alone(case: str) -> dict:
    """Each collective at each size, in turn for ``ROUNDS`` rounds after ``WARMUP`` (which compile the graphs): timed
    alone (wait for the device, host clock, the op, wait) and under the comms logger, one right after the other and
    each first in every other round, so that the machine's load hits both alike; the rounds' wall time, and what
    ``log_summary`` returns."""
    import time
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.comm import comm as ds_comm
    deepspeed.init_distributed()
    accelerator = deepspeed.get_accelerator()
    calls = {(name, numel): _collective(name, numel, dist.get_world_size(), accelerator.device_name())
             for name in COLLECTIVES for numel in NUMELS}
    logger = ds_comm.comms_logger
    dist.configure(enabled=False, prof_all=True, verbose=False)
    alone = {f"{name} {numel}": [] for name, numel in calls}
    for index in range(WARMUP + ROUNDS):
        if index == WARMUP:
            dist.reset_log()
            for times in alone.values():
                times.clear()
            start = time.perf_counter()
        for (name, numel), (operands, run) in calls.items():
            for logged in (False, True) if index % 2 else (True, False):
                tensor = operands()
                if logged:
                    logger.enabled = True
                    run(tensor)
                    logger.enabled = False
                    continue
                accelerator.synchronize()
                began = time.perf_counter()
                run(tensor)
                accelerator.synchronize()
                alone[f"{name} {numel}"].append((time.perf_counter() - began) * 1000)
    wall = (time.perf_counter() - start) * 1000
    logged = {f"{name} {size}": record[1] for name, sizes in logger.comms_dict.items() for size, record in sizes.items()}
    summary = dist.log_summary(return_dict=True, show_straggler=True)
    return {"alone": alone, "logged": logged, "wall_ms": wall,
            **{part: {f"{name} {size}": entry for name, sizes in summary[part].items() for size, entry in sizes.items()}
               for part in ("summary", "straggler_analysis")}}


def logger_rank() -> None:
    from tests.multiproc import record_cases
    record_cases(["ops"], logged_and_alone, LOGGER_OUT)


def test_the_logged_latency_is_the_collectives_own_at_two_ranks(tmp_path):
    """Two XLA ranks on PJRT CPU, three collectives at two sizes, each op timed alone and logged in turn: per op and
    size, the average the logger reports without stragglers (``log_summary``'s straggler analysis: the trimmed mean of
    each call's fastest rank) is within 25 % of the same average of the op timed alone. Upstream's running sums grow
    with every round; the matmuls left pending before each op, which ``timed_op``'s one wait (after the op) would time
    with it, made the average 1.3-2.3x the op's timed alone. The deterministic part: every op logged once per call, under its
    input's size in bytes, its total the sum of its latencies and its average their trimmed mean; all the logged
    latencies and all the times alone fit in the rounds' wall time (disjoint parts of it; upstream's sums do not)."""
    from deepspeed.utils.timer import trim_mean
    from tests.multiproc import run_rank_records
    records = [record["ops"] for record in run_rank_records(f"{__name__}:logger_rank", "xla", 2, tmp_path / "logger",
                                                             LOGGER_OUT)]
    for ops in records:
        assert "failed" not in ops, ops.get("failed")
    expected = {f"{name} {numel * 4}": f"{name} {numel}" for name in COLLECTIVES for numel in NUMELS}  # fp32 bytes
    for logged_as, call in expected.items():
        for ops in records:
            latencies = ops["logged"][logged_as]
            assert len(latencies) == ROUNDS and ops["summary"][logged_as]["count"] == ROUNDS, logged_as
            assert ops["summary"][logged_as]["total_latency_ms"] == pytest.approx(sum(latencies))
            assert ops["summary"][logged_as]["avg_latency_ms"] == pytest.approx(trim_mean(latencies, 0.1))
        logged, alone = ([min(times) for times in zip(*(ops[part][key] for ops in records))]
                         for part, key in (("logged", logged_as), ("alone", call)))
        reported = records[0]["straggler_analysis"][logged_as]
        assert reported["count"] == ROUNDS and reported["avg_comm_lat_ms"] == pytest.approx(trim_mean(logged, 0.1))
        assert abs(trim_mean(logged, 0.1) / trim_mean(alone, 0.1) - 1) <= 0.25, (call, logged, alone)
    for ops in records:
        assert set(ops["logged"]) == set(expected)
        spent = sum(map(sum, ops["logged"].values())) + sum(map(sum, ops["alone"].values()))
        assert spent <= ops["wall_ms"], (spent, ops["wall_ms"])
