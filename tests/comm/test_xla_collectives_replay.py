"""DeepSpeed's own sequences of collectives, replayed on ``xla_ds`` across XLA devices.

``record_collectives.py`` recorded what small ZeRO-1/2/3, MoE and pipe x data trainings issue on ``xla_host`` (each
call's group, options, tensors before and after); each XLA thread of ``xla_threads`` replays its rank's calls in order
on ``xla_ds`` groups and compares every tensor afterwards with the recorded one. A non-root's tensor after ``reduce``
is not compared, and inputs are compared with what they were before (gloo, under ``xla_host``, uses them as
scratch): every method's outputs are its first argument.
"""
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from tests.comm import xla_threads
from tests.comm.record_collectives import RECORDINGS, RUNS


def _decode(value, tensors):
    if isinstance(value, dict) and not value.keys() & {"tensor", "options"}:
        return {key: _decode(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [_decode(item, tensors) for item in value]
    if isinstance(value, dict) and "tensor" in value:
        return tensors[value["tensor"]]
    if isinstance(value, dict) and "options" in value:
        options = getattr(c10d, value["options"])()
        for name, field in value.items():
            if name != "options":
                setattr(options, name, getattr(dist.ReduceOp, field) if name == "reduceOp" else field)
        return options
    return value


def _positions(value):
    """The tensor positions in an encoded argument."""
    if isinstance(value, list):
        return [position for item in value for position in _positions(item)]
    return [value["tensor"]] if isinstance(value, dict) and "tensor" in value else []


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if not want.is_floating_point():
        return torch.equal(got, want)
    tolerance = {torch.float32: (1e-5, 1e-6)}.get(want.dtype, (1.6e-2, 1e-3))  # bf16/fp16: sums in another order
    return got.dtype == want.dtype and torch.allclose(got.float(), want.float(), *tolerance)


def replay_scenario(rank) -> None:
    """Each recording of ``DSX_REPLAY`` (comma-separated), one after the other, on fresh groups."""
    if not rank.is_xla:
        return  # the recording is the reference
    for name in os.environ["DSX_REPLAY"].split(","):
        rank.facts[name] = _replay(rank, name)


def _replay(rank, name: str) -> dict:
    calls = torch.load(RECORDINGS / f"{name}.rank{rank.rank}.pt")
    wrong, methods, groups = [], {}, {}
    for index, call in enumerate(calls):
        ranks = None if call["world"] else tuple(call["ranks"])
        if (name, ranks) not in groups:  # each recording's groups afresh, as its training built them
            groups[name, ranks] = rank.group(ranks, tag=name)
        group = groups[name, ranks]
        tensors = [t.clone().to(rank.device) if device == "xla" else t.clone()
                   for t, device in zip(call["before"], call["devices"])]
        args, kwargs = _decode(call["args"], tensors), _decode(call["kwargs"], tensors)
        getattr(group, call["method"])(*args, **kwargs).wait()
        rank.cut()
        root = next((a.rootRank for a in args if hasattr(a, "rootRank")), None)
        skip = call["method"] == "reduce" and group.rank() != root
        methods[call["method"]] = methods.get(call["method"], 0) + 1
        outputs = set(_positions(call["args"][0])) if call["args"] else set()
        for position, got in enumerate(tensors):
            want = call["after"][position] if position in outputs else call["before"][position]
            if not (skip and position in outputs) and not _close(got.cpu(), want):
                wrong.append(f"call {index} {call['method']} on {call['ranks']}, tensor {position}: "
                             f"max difference {(got.cpu().float() - want.float()).abs().max().item()}")
    return {"wrong": wrong, "calls": len(calls), "methods": methods}


def test_every_run_has_a_recording():
    """``python -m tests.comm.record_collectives`` writes them; a missing one would silently replay nothing."""
    missing = [f"{name}.rank{rank}.pt" for name, (world, _, _) in RUNS.items() for rank in range(world)
               if not (RECORDINGS / f"{name}.rank{rank}.pt").exists()]
    assert not missing


@pytest.mark.parametrize("world", [2, 4])
def test_deepspeeds_collectives_give_on_xla_devices_what_they_gave_on_xla_host(world, tmp_path):
    names = [name for name, (ranks, _, _) in RUNS.items() if ranks == world]
    results = xla_threads.run("tests.comm.test_xla_collectives_replay:replay_scenario", world, tmp_path,
                              timeout=600, DSX_REPLAY=",".join(names))
    for rank in range(world):
        for name in names:
            facts = results["xla"][rank]["facts"][name]
            assert facts["calls"] > 0 and not facts["wrong"], (name, rank, facts["methods"], facts["wrong"][:5])
