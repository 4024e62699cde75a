"""The rank side of ``test_host_staged.py``, after the collectives one by one: sub-groups and one-rank groups,
asynchronous work, coalescing, the cost of staging and its pooled buffers, and the ranks' agreement on what they
pass; registered into ``host_staged_checks.CHECKS`` after its checks: ``CHECKS`` here is every check, in order."""
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

from deepspeed_xla.comm import agreement, host_buffers, staging
from tests.comm.host_staged_checks import (AVG, CHECKS, MAX, SHAPES, TIMEOUT, WORLD, check, expect, own_group, reduced,
                                          stale, values, xla, xla_metrics)

__all__ = ["CHECKS"]


@check
def subgroups(rank):
    pair = dist.new_group([0, 1])
    tensor = xla(values(rank, (3, 5)))
    dist.all_reduce(tensor, group=pair)
    expect("all_reduce in new_group([0, 1])", tensor, reduced("SUM", (3, 5), torch.float32))
    output = stale((WORLD * 7,), torch.bfloat16)
    dist.all_gather_into_tensor(output, xla(values(rank, (7,), torch.bfloat16)), group=pair)
    expect("all_gather_into_tensor in new_group([0, 1])", output,
           torch.cat([values(r, (7,), torch.bfloat16) for r in range(WORLD)]))
    tensor = xla(values(rank, (7,)))
    dist.broadcast(tensor, src=1, group=pair)
    expect("broadcast in new_group([0, 1])", tensor, values(1, (7,)))

    alone = own_group(rank)
    assert dist.get_world_size(alone) == 1 and dist.get_rank(alone) == 0
    tensor = xla(values(rank, (7,)))
    dist.all_reduce(tensor, group=alone)
    expect("all_reduce alone", tensor, values(rank, (7,)))
    output = stale((7,), torch.int64)
    dist.all_gather_into_tensor(output, xla(values(rank, (7,), torch.int64)), group=alone)
    expect("all_gather_into_tensor alone", output, values(rank, (7,), torch.int64))
    output = stale((7,))
    dist.reduce_scatter_tensor(output, xla(values(rank, (7,))), group=alone)
    expect("reduce_scatter_tensor alone", output, values(rank, (7,)))
    tensor = xla(values(rank, (7,)))
    dist.broadcast(tensor, src=rank, group=alone)
    expect("broadcast alone", tensor, values(rank, (7,)))


@check
def one_rank_groups_stay_on_device(rank):
    """A group of one (every group of a one-process run) copies on the device: no execution, no transfer."""
    def counts():
        return xla_metrics("ExecuteTime", "TransferFromDeviceTime")

    alone = own_group(rank)
    before = counts()
    reduced_ = xla(values(rank, (7,))) * 2  # pending results: staging them would execute a graph
    dist.all_reduce(reduced_, group=alone)
    gathered = [stale((3, 5))]
    dist.all_gather(gathered, xla(values(rank, (3, 5))) * 2, group=alone)
    single = stale((7,))
    dist.all_to_all_single(single, xla(values(rank, (7,))) * 2, group=alone)
    pieces = [stale((7,), torch.int64)]
    dist.all_to_all(pieces, [xla(values(rank, (7,), torch.int64)) * 2], group=alone)
    scattered = stale((7,))
    dist.reduce_scatter(scattered, [xla(values(rank, (7,))) * 2], group=alone)
    assert counts() == before, f"rank {rank}: one-rank collectives executed or transferred: {before} -> {counts()}"
    for what, got, dtype in [("all_reduce", reduced_, torch.float32), ("all_gather", gathered[0], None),
                             ("all_to_all_single", single, torch.float32), ("all_to_all", pieces[0], torch.int64),
                             ("reduce_scatter", scattered, torch.float32)]:
        expect(f"{what} alone", got, values(rank, tuple(got.shape), dtype or torch.float32) * 2)


@check
def async_handles(rank):
    tensor = xla(values(rank, (7,)))
    gathered = stale((WORLD * 7,), torch.bfloat16)
    scattered = stale((7,))
    broadcasted = xla(values(rank, (3, 5), torch.int64))
    works = [dist.all_reduce(tensor, op=AVG, async_op=True),
             dist.all_gather_into_tensor(gathered, xla(values(rank, (7,), torch.bfloat16)), async_op=True),
             dist.reduce_scatter_tensor(scattered, xla(values(rank, (WORLD * 7,))), async_op=True),
             dist.broadcast(broadcasted, src=0, async_op=True)]
    for work in works:
        assert work.wait()
    expect("async all_reduce", tensor, reduced("AVG", (7,), torch.float32))
    expect("async all_gather_into_tensor", gathered, torch.cat([values(r, (7,), torch.bfloat16) for r in range(WORLD)]))
    expect("async reduce_scatter_tensor", scattered, reduced("SUM", (WORLD * 7,), torch.float32).chunk(WORLD)[rank])
    expect("async broadcast", broadcasted, values(0, (3, 5), torch.int64))


@check
def async_ops_run_together(rank):
    """ZeRO-3's persistent-parameter gather: one async all-gather per tensor, waited on at the end, is
    one XLA execution for all of them; ops issued later see their results and do not change their inputs."""
    def executions():
        return xla_metrics("ExecuteTime")[0][0]

    inputs = [xla(values(rank, shape, torch.float32, salt)) * 3 for salt, shape in enumerate(SHAPES * 2)]
    outputs = [stale((WORLD * t.numel(),)) for t in inputs]
    before = executions()
    works = [dist.all_gather_into_tensor(out, inp.flatten(), async_op=True) for out, inp in zip(outputs, inputs)]
    issued = executions()
    for work in works:
        assert work.wait()
    assert (issued - before, executions() - issued) == (0, 1), \
        f"rank {rank}: {issued - before} executions at issue, {executions() - issued} at wait (want 0, 1)"
    for salt, (shape, output) in enumerate(zip(SHAPES * 2, outputs)):
        want = torch.cat([values(r, shape, torch.float32, salt).flatten() * 3 for r in range(WORLD)])
        expect(f"async all_gather_into_tensor {shape} #{salt}", output, want)

    summed = xla(values(rank, (7,)))
    gathered = stale((WORLD * 7,))
    first = dist.all_reduce(summed, async_op=True)
    second = dist.all_gather_into_tensor(gathered, summed, async_op=True)
    second.wait()
    first.wait()
    total = reduced("SUM", (7,), torch.float32)
    expect("all_gather of an async all_reduce's output", gathered, torch.cat([total] * WORLD))

    alone = own_group(rank)
    source = xla(values(rank, (7,)))
    gathered = stale((WORLD * 7,))
    queued = dist.all_gather_into_tensor(gathered, source, async_op=True)
    dist.all_gather_into_tensor(source, xla(values(rank, (7,))) * 5, group=alone)  # runs at once, on the device
    queued.wait()
    expect("async all_gather whose input a later one-rank op overwrote", gathered,
           torch.cat([values(r, (7,)) for r in range(WORLD)]))
    expect("the one-rank op's output", source, values(rank, (7,)) * 5)


@check
def coalescing_manager(rank):
    """ZeRO-3's path (deepspeed/comm/torch.py ``all_gather_coalesced``), then the other fast paths."""
    for async_ops in (False, True):
        inputs = [xla(values(rank, shape, torch.float32, salt)) for salt, shape in enumerate(SHAPES)]
        outputs = [stale((WORLD * t.numel(),)) for t in inputs]
        with _coalescing_manager(None, device=inputs[0].device, async_ops=async_ops) as cm:
            for output, input in zip(outputs, inputs):
                dist.all_gather_into_tensor(output, input.flatten(), async_op=True)
        if async_ops:
            cm.wait()
        for salt, (shape, output) in enumerate(zip(SHAPES, outputs)):
            want = torch.cat([values(r, shape, torch.float32, salt).flatten() for r in range(WORLD)])
            expect(f"coalesced all_gather_into_tensor {shape} async_ops={async_ops}", output, want)

    tensors = [xla(values(rank, shape, torch.bfloat16, salt)) for salt, shape in enumerate(SHAPES)]
    with _coalescing_manager(None, device=tensors[0].device):
        for tensor in tensors:
            dist.all_reduce(tensor, op=MAX)
    for salt, (shape, tensor) in enumerate(zip(SHAPES, tensors)):
        expect(f"coalesced all_reduce {shape}", tensor, reduced("MAX", shape, torch.bfloat16, salt))

    outputs = [stale(shape) for shape in SHAPES]
    with _coalescing_manager(None, device=outputs[0].device):
        for salt, (shape, output) in enumerate(zip(SHAPES, outputs)):
            full = (WORLD * shape[0],) + shape[1:]
            dist.reduce_scatter_tensor(output, xla(values(rank, full, torch.float32, salt)))
    for salt, (shape, output) in enumerate(zip(SHAPES, outputs)):
        full = (WORLD * shape[0],) + shape[1:]
        expect(f"coalesced reduce_scatter_tensor {shape}", output, reduced("SUM", full, torch.float32, salt).chunk(WORLD)[rank])


@check
def staging_cost(rank):
    """One XLA execution for all operands of an op, and no device-to-host copy of its pure outputs."""
    def counts():
        return xla_metrics("ExecuteTime", "InboundData")

    inputs = [xla(values(rank, shape, torch.float32, salt)) * 2 for salt, shape in enumerate(SHAPES)]
    outputs = [stale((WORLD * t.numel(),)) for t in inputs]  # pending fills: reading them would execute
    (executions, _), (transfers, inbound) = counts()
    with _coalescing_manager(None, device=inputs[0].device):
        for output, input in zip(outputs, inputs):
            dist.all_gather_into_tensor(output, input.flatten())
    (executions_after, _), (transfers_after, inbound_after) = counts()
    assert executions_after - executions == 1, f"rank {rank}: {executions_after - executions} XLA executions"
    zero_copy = staging.zero_copy()
    input_bytes = 0 if zero_copy else sum(t.numel() * t.element_size() for t in inputs)
    assert transfers_after - transfers == (0 if zero_copy else 1), \
        f"rank {rank}: {transfers_after - transfers} device-to-host transfers (zero copy: {zero_copy})"
    assert inbound_after - inbound == input_bytes, \
        f"rank {rank}: {inbound_after - inbound:.0f} bytes copied to host, expected {input_bytes}"
    for salt, (shape, output) in enumerate(zip(SHAPES, outputs)):
        want = torch.cat([values(r, shape, torch.float32, salt).flatten() * 2 for r in range(WORLD)])
        expect(f"staged all_gather_into_tensor {shape}", output, want)


@check
def pooled_buffers_keep_results(rank):
    """Results written into reused host buffers (``host_buffers``): each held result keeps its values
    while later collectives of the same size run, and a tensor all-reduced again and again stays right."""
    pooled_bytes, host_buffers.POOLED_BYTES = host_buffers.POOLED_BYTES, 64  # pool these small tensors
    try:
        shape = (5, 7)
        held = []
        for salt in range(host_buffers.PER_SIZE + 2):
            tensor = xla(values(rank, shape, salt=salt))
            dist.all_reduce(tensor)
            gathered = stale((WORLD,) + shape)
            dist.all_gather_into_tensor(gathered, xla(values(rank, shape, salt=salt)))
            held.append((salt, tensor, gathered))
        repeated = xla(values(rank, shape))
        for _ in range(3):
            dist.all_reduce(repeated)
        for salt, tensor, gathered in held:
            expect(f"held all_reduce #{salt}", tensor, reduced("SUM", shape, torch.float32, salt))
            expect(f"held all_gather #{salt}", gathered, torch.stack([values(r, shape, salt=salt) for r in range(WORLD)]))
        expect("all_reduce three times", repeated, reduced("SUM", shape, torch.float32) * WORLD ** 2)
    finally:
        host_buffers.POOLED_BYTES = pooled_bytes


@check
def synchronize_runs_issued_collectives(rank):
    """The accelerator's ``synchronize`` finishes collectives issued with ``async_op=True`` and not waited on, as
    ``torch.cuda.synchronize`` finishes NCCL's: their outputs are complete after it."""
    from deepspeed_xla.accelerator import XLA_Accelerator
    shape = (3, 5)
    tensor = xla(values(rank, shape, salt=7))
    gathered = stale((WORLD,) + shape)
    dist.all_reduce(tensor, async_op=True)
    dist.all_gather_into_tensor(gathered, xla(values(rank, shape, salt=8)), async_op=True)
    XLA_Accelerator().synchronize()
    expect("all_reduce issued before synchronize", tensor, reduced("SUM", shape, torch.float32, 7))
    expect("all_gather issued before synchronize", gathered, torch.stack([values(r, shape, salt=8) for r in range(WORLD)]))


@check
def ranks_that_wait_at_other_points_agree(rank):
    """Rank 0 waits on each asynchronous op as it issues it, rank 1 on the last one only: their queues run in other
    batches, and the ops still agree (``agreement`` compares them op by op) and give the right results. Messages
    cut at 64 bytes: each batch's signatures take two."""
    tensors = [xla(values(rank, (7,), salt=salt)) for salt in range(3)]
    gathered = stale((WORLD * 7,), torch.bfloat16)
    works = []
    chunk, agreement.CHUNK = agreement.CHUNK, 64  # the receives the checks before posted have room for more
    try:
        for tensor in tensors:
            works.append(dist.all_reduce(tensor, async_op=True))
            if rank == 0:
                works[-1].wait()
        works.append(dist.all_gather_into_tensor(gathered, xla(values(rank, (7,), torch.bfloat16)), async_op=True))
        works[-1].wait()
    finally:
        agreement.CHUNK = chunk
    for salt, tensor in enumerate(tensors):
        expect(f"all_reduce #{salt} waited on {'at once' if rank == 0 else 'last'}", tensor,
               reduced("SUM", (7,), torch.float32, salt))
    expect("all_gather_into_tensor after them", gathered,
           torch.cat([values(r, (7,), torch.bfloat16) for r in range(WORLD)]))


# Each op, called with what each rank passes: (shape, dtype) of the operand.
DISAGREEING = {
    "all_reduce": lambda shape, dtype: dist.all_reduce(xla(torch.zeros(shape, dtype=dtype))),
    "all_gather": lambda shape, dtype: dist.all_gather([stale(shape, dtype) for _ in range(WORLD)],
                                                       xla(torch.zeros(shape, dtype=dtype))),
    "all_gather_into_tensor": lambda shape, dtype: dist.all_gather_into_tensor(
        stale((WORLD * shape[0],), dtype), xla(torch.zeros(shape, dtype=dtype))),
    "broadcast": lambda shape, dtype: dist.broadcast(xla(torch.zeros(shape, dtype=dtype)), src=0),
    "reduce_scatter": lambda shape, dtype: dist.reduce_scatter(
        stale(shape, dtype), [xla(torch.zeros(shape, dtype=dtype)) for _ in range(WORLD)]),
    "reduce_scatter_tensor": lambda shape, dtype: dist.reduce_scatter_tensor(
        stale(shape, dtype), xla(torch.zeros((WORLD * shape[0],), dtype=dtype))),
}
# What rank 0 and rank 1 pass: the larger operand on either rank, and dtypes of the same and of another width.
MISMATCHES = {"rank 1 larger": (((4,), torch.float32), ((8,), torch.float32)),
              "rank 0 larger": (((8,), torch.float32), ((4,), torch.float32)),
              "dtype of the same width": (((4,), torch.float32), ((4,), torch.int32)),
              "narrower dtype": (((4,), torch.bfloat16), ((4,), torch.float32))}


@check
def disagreeing_ranks_raise(rank):
    """Ranks that pass a collective operands of other sizes or dtypes each raise one error, the same on both, naming
    the op and what each rank passed; at once, not gloo's abort, a partial or garbled result, or the timeout."""
    for op, call in DISAGREEING.items():
        for case, passed in MISMATCHES.items():
            started = time.monotonic()
            with pytest.raises(RuntimeError, match="the same dtypes and sizes") as raised:
                call(*passed[rank])
            elapsed, message = time.monotonic() - started, str(raised.value)
            assert elapsed < TIMEOUT.total_seconds() / 2, f"rank {rank}, {op} {case}: raised after {elapsed:.0f} s"
            for r, (shape, dtype) in enumerate(passed):
                operand = re.escape(agreement.describe([torch.empty(shape, dtype=dtype)]))
                assert re.search(rf"rank {r}: {op}[ (][^;]*{operand}", message), \
                    f"rank {rank}, {op} {case}: the error does not say rank {r} passed {operand}: {message}"
            messages = [None] * WORLD
            dist.all_gather_object(messages, message)
            assert messages[0] == messages[1], f"{op} {case}: the ranks raised different errors: {messages}"
