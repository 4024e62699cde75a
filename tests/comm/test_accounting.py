"""``comm.accounting``: the collectives a process issues, counted at its process groups' entry points by kind, group
and bytes; on ``xla_ds`` across XLA devices here, on ``xla_host`` in ``tests/bench/test_collective_bytes.py``'s
launched ZeRO trainings."""
import json

import torch
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions, BroadcastOptions,
                                        ProcessGroup, ReduceScatterOptions)

from deepspeed_xla.bench import collective_bytes
from deepspeed_xla.comm import accounting
from tests.comm import xla_threads


def counting_scenario(rank) -> None:
    """One call of each kind on the world of 2 ``xla_ds`` ranks, two of them (the list forms of reduce-scatter and
    all-to-all) through another entry point, then each rank's view of the process's totals."""
    if not rank.is_xla:
        return
    world, put = rank.group(), rank.tensor
    calls = [
        lambda: world.allreduce([put(torch.ones(5))], AllreduceOptions()),
        lambda: world._allgather_base(put(torch.zeros(6)), put(torch.ones(3)), AllgatherOptions()),
        lambda: world.reduce_scatter([put(torch.zeros(2))], [[put(torch.ones(2)), put(torch.ones(2))]],
                                     ReduceScatterOptions()),
        lambda: world.alltoall([put(torch.zeros(1)), put(torch.zeros(1))], [put(torch.ones(1)), put(torch.ones(1))],
                               AllToAllOptions()),
        lambda: world.broadcast([put(torch.ones(3, dtype=torch.bfloat16))], BroadcastOptions()),
    ]
    for call in calls:
        call().wait()
        rank.cut()
    rank.settle()
    rank.facts["totals"] = accounting.totals()


def test_xla_ds_counts_each_call_once_by_kind_group_and_bytes(tmp_path):
    """Both ranks are threads of one process, so each kind is counted twice; the list forms, which ``xla_ds`` runs
    through the tensor forms, count once."""
    results = xla_threads.run("tests.comm.test_accounting:counting_scenario", 2, tmp_path,
                              **{accounting.ENV: str(tmp_path / "counted")})
    fp32, bf16 = 4, 2
    per_rank = {"all-reduce": 5 * fp32, "all-gather": 6 * fp32, "reduce-scatter": 4 * fp32, "all-to-all": 2 * fp32,
                "broadcast": 3 * bf16}
    expected = [{"kind": kind, "ranks": [0, 1], "calls": 2, "bytes": 2 * nbytes}
                for kind, nbytes in sorted(per_rank.items())]
    for rank in range(2):
        assert results["xla"][rank]["facts"]["totals"] == expected


class _Group(ProcessGroup):
    """A group of 2 whose collectives do nothing: what the counting layer sees of a call."""

    def __init__(self):
        super().__init__(0, 2)

    def allreduce(self, tensors, opts):
        return None

    def gather(self, output_lists, inputs, opts):
        return None


def test_off_nothing_is_wrapped(monkeypatch):
    monkeypatch.delenv(accounting.ENV, raising=False)
    group_class = type("Off", (_Group, ), {})
    methods = dict(vars(group_class))
    assert accounting.instrument(group_class) is group_class and dict(vars(group_class)) == methods


def test_marks_hold_the_totals_so_far_and_their_difference_is_per_step(monkeypatch, tmp_path):
    monkeypatch.setattr(accounting, "_TOTALS", {})
    prefix, env = tmp_path / "counted", {}
    collective_bytes.count_in(env, prefix)
    monkeypatch.setenv(accounting.ENV, env[accounting.ENV])
    group = accounting.instrument(type("On", (_Group, ), {}))()
    group.allreduce([torch.ones(3)], None)  # before the first mark: start-up
    accounting.mark()
    for _ in range(2):  # two steps
        group.allreduce([torch.ones(8, dtype=torch.bfloat16)], None)
        group.gather([], [torch.ones(5)], None)  # a gather's whole tensor: every member's input
    accounting.mark()
    lines = [json.loads(line) for line in (tmp_path / "counted.rank0.jsonl").read_text().splitlines()]
    assert [line["rank"] for line in lines] == [0, 0]
    marks = collective_bytes.read_marks(prefix, 1)[0]
    assert collective_bytes.per_step(marks[0], marks[1], 2) == [
        {"kind": "all-reduce", "ranks": [0, 1], "group_size": 2, "calls_per_step": 1, "bytes_per_step": 16},
        {"kind": "gather", "ranks": [0, 1], "group_size": 2, "calls_per_step": 1, "bytes_per_step": 40}]
