"""Collective bytes per step of 2-process ZeRO trainings, counted at the process groups (``comm.accounting``,
``bench.collective_bytes``), against what ZeRO's algorithm needs for the model, computed here from its parameters.

One launched job (``tests/train_many.py``) trains ZeRO-1, ZeRO-2 (DeepSpeed's default, and reducing each gradient
partition to its owner) and ZeRO-3 (prefetching, and releasing every parameter) for a few steps on 2 ranks with
counting on; each run marks its totals where ``scripts/train.py`` reads its graph counters, after the warm-up and at
the end. The bench's summary and table are checked on written marks.
"""
import argparse
import json

import pytest

from deepspeed_xla.bench import collective_bytes
from tests.multiproc import TRAIN_MANY, ds_config, launch_command, run_job

MODEL = {"dim": 16, "layers": 2, "seq": 8, "vocab": 32}
WARMUP, STEPS = 2, 4  # ZeRO-3 records its parameters' order in the first step and prefetches by it from the second
N = 2  # ranks
RUNS = {
    "zero1": ds_config(1, micro_batch=2),
    "zero2": ds_config(2, micro_batch=2),
    # each gradient partition reduced to its owner: what a reduce-scatter moves
    "zero2-reduce": ds_config(2, micro_batch=2, zero_optimization={
        "stage": 2, "contiguous_gradients": True, "use_multi_rank_bucket_allreduce": False}),
    "zero3": ds_config(3, micro_batch=2),  # stage3_param_persistence_threshold 0: no parameter stays gathered
    # no prefetch and no reuse: every parameter released after its forward use and gathered again for its backward
    "zero3-release": ds_config(3, micro_batch=2, zero_optimization={
        "stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
        "stage3_max_reuse_distance": 0}),
}
FP32 = 4
NORM = FP32  # the gradient norm's all-reduce: one fp32 scalar


@pytest.fixture(scope="module")
def counted(tmp_path_factory, train_module) -> dict:
    """Each run's collectives per step on each rank (``bench.collective_bytes.per_step``: {kind: (calls, bytes)}), and
    the model's parameter sizes."""
    workdir = tmp_path_factory.mktemp("collective_bytes")
    args = [f"--{name}={value}" for name, value in MODEL.items()]
    runs = []
    for name, config in RUNS.items():
        (workdir / f"{name}.json").write_text(json.dumps(config))
        runs.append({"args": ["--deepspeed_config", str(workdir / f"{name}.json"), "--steps", str(STEPS),
                              "--warmup-steps", str(WARMUP), *args]})
    (workdir / "runs.json").write_text(json.dumps(runs))
    prefix, env = workdir / "collectives", {}
    collective_bytes.count_in(env, prefix)
    cmd, env = launch_command([TRAIN_MANY, "--runs", workdir / "runs.json"], "xla", N, env)
    run_job(cmd, env, workdir, timeout=600)
    marks = collective_bytes.read_marks(prefix, N)
    assert [len(rank) for rank in marks] == [2 * len(RUNS)] * N, "each run marks after its warm-up and at its end"
    runs = {name: [_by_kind(collective_bytes.per_step(rank[2 * i], rank[2 * i + 1], STEPS - WARMUP))
                   for rank in marks] for i, name in enumerate(RUNS)}
    model = train_module.TinyGPT(MODEL["vocab"], MODEL["dim"], MODEL["layers"], seq=MODEL["seq"])
    return {"runs": runs, "sizes": [p.numel() for p in model.parameters()]}


def _by_kind(entries) -> dict:
    """{kind: (calls, bytes) per step}; every collective on the world's 2 ranks."""
    assert all(entry["ranks"] == list(range(N)) for entry in entries), entries
    return {entry["kind"]: (entry["calls_per_step"], entry["bytes_per_step"]) for entry in entries}


def _padded(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


def _flat_bytes(sizes) -> int:
    """ZeRO-1/2's flat fp32 buffer of all parameters: DeepSpeed pads it to a multiple of 2 elements per rank."""
    return _padded(sum(sizes), 2 * N) * FP32


def _partitioned_bytes(sizes) -> int:
    """ZeRO-3's parameters (or gradients) whole: each is padded to a multiple of the ranks."""
    return sum(_padded(size, N) for size in sizes) * FP32


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_zero12_all_reduce_the_gradients_and_all_gather_the_parameters(counted, stage):
    """DeepSpeed 0.19.8 all-reduces the whole gradient (its default ``use_multi_rank_bucket_allreduce``; with or
    without ``reduce_scatter``) where the algorithm needs a reduce-scatter: the same bytes, twice a reduce-scatter's
    on the wire. Then one all-gather of the updated parameters, and the gradient norm's scalar all-reduce."""
    model = _flat_bytes(counted["sizes"])
    for rank in counted["runs"][stage]:
        assert rank == {"all-reduce": (2, model + NORM), "all-gather": (1, model)}


def test_zero2_reducing_to_owners_moves_a_reduce_scatter(counted):
    """With ``use_multi_rank_bucket_allreduce`` off, each rank's gradient partition is reduced to it: one reduce per
    rank, together the model's bytes."""
    model = _flat_bytes(counted["sizes"])
    for rank in counted["runs"]["zero2-reduce"]:
        assert rank == {"reduce": (N, model), "all-reduce": (1, NORM), "all-gather": (1, model)}


@pytest.mark.parametrize("run, gathers", [("zero3", 1), ("zero3-release", 2)])
def test_zero3_gathers_as_its_prefetch_and_release_schedule_implies(counted, run, gathers):
    """DeepSpeed's prefetch looks ahead over the recorded order into the backward and keeps a parameter it will use
    again gathered: this model is gathered once per step. Without prefetch and reuse, each parameter is gathered for
    its forward, released, and gathered again for its backward. The gradients are reduce-scattered once."""
    model = _partitioned_bytes(counted["sizes"])
    for rank in counted["runs"][run]:
        assert {kind: figures[1] for kind, figures in rank.items()} == {
            "all-gather": gathers * model, "reduce-scatter": model, "all-reduce": NORM}
        assert rank["reduce-scatter"][0] == rank["all-reduce"][0] == 1


def _write_marks(prefix, rank: int, *marks) -> None:
    lines = [json.dumps({"rank": rank, "totals": totals}) for totals in marks]
    prefix.with_name(f"{prefix.name}.rank{rank}.jsonl").write_text("\n".join(lines) + "\n")


def test_the_bench_reports_the_busiest_rank_and_the_ring_bytes_each_device_sends(tmp_path):
    """A pipeline's ranks differ: rank 0 sends its activations; both all-reduce over the world, rank 1 more
    (``collective_bytes.summary``, over 2 steps between the marks)."""
    prefix = tmp_path / "system.collectives"
    start = [{"kind": "all-reduce", "ranks": [0, 1], "calls": 3, "bytes": 300}]
    _write_marks(prefix, 0, start, [{"kind": "all-reduce", "ranks": [0, 1], "calls": 5, "bytes": 700},
                                    {"kind": "send", "ranks": [0, 1], "calls": 2, "bytes": 64}])
    _write_marks(prefix, 1, start, [{"kind": "all-reduce", "ranks": [0, 1], "calls": 5, "bytes": 1100}])
    counted = collective_bytes.summary(prefix, 2, 2)
    assert counted["collectives"] == [
        {"kind": "all-reduce", "ranks": [0, 1], "group_size": 2, "calls_per_step": 1, "bytes_per_step": 400,
         "wire_bytes_per_step": 400},  # a ring all-reduce sends 2(n-1)/n of the tensor
        {"kind": "send", "ranks": [0, 1], "group_size": 2, "calls_per_step": 1, "bytes_per_step": 32,
         "wire_bytes_per_step": 32}]
    assert (counted["bytes_per_step"], counted["wire_bytes_per_step"]) == (432, 432)
    row = {"system": "xla-zero1-2p-pipe", "cost": {}}
    collective_bytes.attach(row, prefix, argparse.Namespace(procs=2), argparse.Namespace(steps=5, warmup=3, tpu="v5e"))
    assert row["cost"]["collectives_counted"] == dict(counted, tpu="v5e", collective_s=432 / 400e9)  # v5e: 400 GB/s
    assert [line.split() for line in collective_bytes.table([row])[-3:]] == [
        ["xla-zero1-2p-pipe", "all-reduce", "2", "1.00", "400", "400"],
        ["xla-zero1-2p-pipe", "send", "2", "1.00", "32", "32"],
        ["xla-zero1-2p-pipe", "total", "432", "432", "est.", "0.00108", "us", "on", "one", "v5e's", "ICI"]]


def test_a_system_that_marked_nothing_reports_why(tmp_path):
    counted = collective_bytes.summary(tmp_path / "none.collectives", 2, 3)
    assert "marked no collectives" in counted["error"]
    lines = collective_bytes.table([{"system": "s", "cost": {"collectives_counted": counted}}])
    assert "marked no collectives" in lines[-1]
