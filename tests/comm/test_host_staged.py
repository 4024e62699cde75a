"""The ``xla_host`` backend on two PJRT CPU processes: every collective, on real XLA tensors; and the reductions on
three, where gloo reduces in place (two ranks swap operands instead).

One 2-rank launch runs all checks in order (importing torch_xla costs seconds per process). Each rank
prints ``PASS <check>`` after a check; the first failure ends that rank with its traceback, and its
peer then fails on the next collective (or the group's 60 s timeout), so a broken check cannot hang
the run; ``test_collective[<check>]`` names the first check that failed.
"""
import math
import re
import time
from datetime import timedelta
from typing import Callable, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

from deepspeed_xla.comm import agreement, backends, host_buffers, staging
from tests.multiproc import run_ranks

WORLD = 2
TIMEOUT = timedelta(seconds=60)
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
SHAPES = ((7,), (3, 5))
SUM, MAX, AVG = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG
REDUCE = {"SUM": (SUM, lambda t: t.sum(0)), "MAX": (MAX, lambda t: t.amax(0)), "AVG": (AVG, lambda t: t.mean(0)),
          "MIN": (dist.ReduceOp.MIN, lambda t: t.amin(0)), "PRODUCT": (dist.ReduceOp.PRODUCT, lambda t: t.prod(0))}

CHECKS = []


def check(fn: Callable[[int], None]) -> Callable[[int], None]:
    """Add ``fn(rank)`` to the checks every rank runs, in definition order."""
    CHECKS.append(fn)
    return fn


def values(rank: int, shape, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    """Small integers in [-9, 9], a different pattern per rank and salt: exact in bf16, in sums and halves."""
    n = math.prod(shape)
    return ((torch.arange(n) * (2 * rank + 3) + 5 * salt) % 19 - 9).reshape(shape).to(dtype)


def reduced(op: str, shape, dtype, salt: int = 0) -> torch.Tensor:
    """What reducing every rank's ``values(rank, shape, dtype, salt)`` with ``op`` gives."""
    stacked = torch.stack([values(r, shape, dtype, salt).double() for r in range(dist.get_world_size())])
    return REDUCE[op][1](stacked).to(dtype)


def ops_for(dtype: torch.dtype) -> List[str]:
    """The reductions to try on ``dtype``: gloo refuses to average integers."""
    return [op for op in REDUCE if op != "AVG" or dtype.is_floating_point]


def expect(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    rank = dist.get_rank()
    assert got.device.type == "xla", f"rank {rank}, {what}: result is on {got.device}, not an XLA device"
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"rank {rank}, {what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    host = got.cpu()
    assert torch.equal(host, want), f"rank {rank}, {what}:\n got {host}\nwant {want}"


def xla_metrics(*names: str) -> List[Tuple[float, float]]:
    """(count, total) of each torch_xla metric, (0, 0) before its first sample."""
    import torch_xla.debug.metrics as met
    return [tuple((met.metric_data(name) or (0, 0))[:2]) for name in names]


def xla(tensor: torch.Tensor) -> torch.Tensor:
    import torch_xla
    return tensor.to(torch_xla.device())


def own_group(rank: int):
    """A group of ``rank`` alone. new_group is collective: every rank creates every one-rank group, in order."""
    return [dist.new_group([r]) for r in range(WORLD)][rank]


def stale(shape, dtype=torch.float32) -> torch.Tensor:
    """An XLA output buffer full of a value no check expects, so a missed write shows."""
    import torch_xla
    return torch.full(shape, 99, dtype=dtype, device=torch_xla.device())


@check
def all_reduce(rank):
    for dtype in DTYPES:
        for shape in ((),) + SHAPES:
            for op in ops_for(dtype):
                tensor = xla(values(rank, shape, dtype))
                dist.all_reduce(tensor, op=REDUCE[op][0])
                expect(f"all_reduce {op} {dtype} {shape}", tensor, reduced(op, shape, dtype))
    cpu = values(rank, (7,))
    dist.all_reduce(cpu)
    assert torch.equal(cpu, reduced("SUM", (7,), torch.float32)), f"rank {rank}, all_reduce of a CPU tensor: {cpu}"


@check
def all_reduce_coalesced(rank):
    for op in ("SUM", "AVG"):
        tensors = [xla(values(rank, shape, torch.float32, salt)) for salt, shape in enumerate(SHAPES)]
        dist.all_reduce_coalesced(tensors, op=REDUCE[op][0])
        for salt, (shape, tensor) in enumerate(zip(SHAPES, tensors)):
            expect(f"all_reduce_coalesced {op} {shape}", tensor, reduced(op, shape, torch.float32, salt))


@check
def all_gather(rank):
    for dtype in DTYPES:
        for shape in SHAPES:
            tensor = xla(values(rank, shape, dtype))
            outputs = [stale(shape, dtype) for _ in range(WORLD)]
            dist.all_gather(outputs, tensor)
            for r, output in enumerate(outputs):
                expect(f"all_gather {dtype} {shape} from rank {r}", output, values(r, shape, dtype))
            expect(f"all_gather {dtype} {shape} input", tensor, values(rank, shape, dtype))
    # DeepSpeed's fallback gathers into views of one flat buffer.
    flat = stale((WORLD * 7,))
    dist.all_gather(list(flat.chunk(WORLD)), xla(values(rank, (7,))))
    expect("all_gather into chunks", flat, torch.cat([values(r, (7,)) for r in range(WORLD)]))


@check
def all_gather_coalesced(rank):
    inputs = [xla(values(rank, shape, torch.bfloat16, salt)) for salt, shape in enumerate(SHAPES)]
    outputs = [[stale(shape, torch.bfloat16) for shape in SHAPES] for _ in range(WORLD)]
    dist.all_gather_coalesced(outputs, inputs)
    for r in range(WORLD):
        for salt, shape in enumerate(SHAPES):
            expect(f"all_gather_coalesced {shape} from rank {r}", outputs[r][salt],
                   values(r, shape, torch.bfloat16, salt))


@check
def all_gather_into_tensor(rank):
    for dtype in DTYPES:
        for shape in SHAPES:
            want = torch.cat([values(r, shape, dtype) for r in range(WORLD)])
            output = stale(want.shape, dtype)
            dist.all_gather_into_tensor(output, xla(values(rank, shape, dtype)))
            expect(f"all_gather_into_tensor {dtype} {shape}", output, want)
    stacked = stale((WORLD, 3, 5))
    dist.all_gather_into_tensor(stacked, xla(values(rank, (3, 5))))
    expect("all_gather_into_tensor stacked", stacked, torch.stack([values(r, (3, 5)) for r in range(WORLD)]))


@check
def reduce_scatter(rank):
    for dtype in DTYPES:
        for shape in SHAPES:
            for op in ops_for(dtype):
                output = stale(shape, dtype)
                dist.reduce_scatter(output, [xla(values(rank, shape, dtype, salt=j)) for j in range(WORLD)],
                                    op=REDUCE[op][0])
                expect(f"reduce_scatter {op} {dtype} {shape}", output, reduced(op, shape, dtype, salt=rank))


@check
def reduce_scatter_tensor(rank):
    for dtype in DTYPES:
        for shape in SHAPES:
            full = (WORLD * shape[0],) + shape[1:]
            for op in ops_for(dtype):
                output = stale(shape, dtype)
                dist.reduce_scatter_tensor(output, xla(values(rank, full, dtype)), op=REDUCE[op][0])
                want = reduced(op, full, dtype).chunk(WORLD)[rank]
                expect(f"reduce_scatter_tensor {op} {dtype} {shape}", output, want)


@check
def broadcast(rank):
    for src in range(WORLD):
        for dtype in DTYPES:
            for shape in SHAPES:
                tensor = xla(values(rank, shape, dtype))
                dist.broadcast(tensor, src=src)
                expect(f"broadcast from {src} {dtype} {shape}", tensor, values(src, shape, dtype))


@check
def reduce(rank):
    for dtype in DTYPES:
        for op in ops_for(dtype):
            tensor = xla(values(rank, (7,), dtype))
            dist.reduce(tensor, dst=1, op=REDUCE[op][0])
            want = reduced(op, (7,), dtype) if rank == 1 else values(rank, (7,), dtype)
            expect(f"reduce {op} {dtype} to rank 1", tensor, want)


@check
def barrier(rank):
    dist.barrier()
    assert dist.barrier(async_op=True).wait()


@check
def all_to_all_single(rank):
    """Rank r sends r + 2j + 1 rows of 3 to rank j (uneven both ways), then an even split of 1-d data."""
    for dtype in DTYPES:
        sent = [values(rank, (rank + 2 * j + 1, 3), dtype, salt=j) for j in range(WORLD)]
        got = [values(j, (j + 2 * rank + 1, 3), dtype, salt=rank) for j in range(WORLD)]
        output = stale((sum(len(g) for g in got), 3), dtype)
        dist.all_to_all_single(output, xla(torch.cat(sent)), output_split_sizes=[len(g) for g in got],
                               input_split_sizes=[len(s) for s in sent])
        expect(f"all_to_all_single uneven {dtype}", output, torch.cat(got))
    output = stale((WORLD * 7,))
    dist.all_to_all_single(output, xla(values(rank, (WORLD * 7,))))
    expect("all_to_all_single even", output, torch.cat([values(j, (WORLD * 7,)).chunk(WORLD)[rank]
                                                         for j in range(WORLD)]))


@check
def all_to_all(rank):
    for dtype in DTYPES:
        outputs = [stale((j + 2 * rank + 1,), dtype) for j in range(WORLD)]
        dist.all_to_all(outputs, [xla(values(rank, (rank + 2 * j + 1,), dtype, salt=j)) for j in range(WORLD)])
        for j, output in enumerate(outputs):
            expect(f"all_to_all {dtype} from rank {j}", output, values(j, (j + 2 * rank + 1,), dtype, salt=rank))


@check
def gather(rank):
    for dst in range(WORLD):
        for dtype in DTYPES:
            outputs = [stale((3, 5), dtype) for _ in range(WORLD)] if rank == dst else None
            dist.gather(xla(values(rank, (3, 5), dtype)), outputs, dst=dst)
            for r, output in enumerate(outputs or []):
                expect(f"gather to {dst} {dtype} from rank {r}", output, values(r, (3, 5), dtype))


@check
def scatter(rank):
    for src in range(WORLD):
        for dtype in DTYPES:
            chunks = [xla(values(src, (7,), dtype, salt=j)) for j in range(WORLD)] if rank == src else None
            output = stale((7,), dtype)
            dist.scatter(output, chunks, src=src)
            expect(f"scatter from {src} {dtype}", output, values(src, (7,), dtype, salt=rank))


@check
def send_recv(rank):
    peer = 1 - rank
    for dtype in DTYPES:
        if rank == 0:
            dist.send(xla(values(0, (3, 5), dtype)), dst=1)
        else:
            received = stale((3, 5), dtype)
            dist.recv(received, src=0)
            expect(f"recv {dtype}", received, values(0, (3, 5), dtype))
    received = stale((7,))
    works = [dist.isend(xla(values(rank, (7,))), dst=peer), dist.irecv(received, src=peer)]
    for work in works:
        work.wait()
    expect("isend/irecv", received, values(peer, (7,)))
    received = stale((3, 5), torch.bfloat16)
    ops = [dist.P2POp(dist.isend, xla(values(rank, (3, 5), torch.bfloat16)), peer),
           dist.P2POp(dist.irecv, received, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    expect("batch_isend_irecv", received, values(peer, (3, 5), torch.bfloat16))
    if rank == 0:
        dist.send(xla(values(0, (7,), torch.int64)), dst=1)
    else:
        received = stale((7,), torch.int64)
        assert dist.recv(received) == 0, "recv from any source did not name rank 0"
        expect("recv from any source", received, values(0, (7,), torch.int64))


@check
def all_reduce_beside_a_send_in_flight(rank):
    """Two ranks all-reduce by swapping operands (``_pairwise``): under a tag of its own, so a send still in
    flight is not taken for the peer's operand, and without a host copy of the operand."""
    copies = []
    writable = staging.writable
    staging.writable = lambda staged: copies.append(staged) or writable(staged)
    try:
        sent = dist.isend(xla(values(0, (3, 5))), dst=1) if rank == 0 else None
        tensor = xla(values(rank, (7,)))
        dist.all_reduce(tensor)
        expect("all_reduce beside a send", tensor, reduced("SUM", (7,), torch.float32))
        mixed = values(rank, (3,)) if rank == 0 else xla(values(rank, (3,)))  # a CPU and an XLA operand
        dist.all_reduce(mixed)
        assert torch.equal(mixed.cpu(), reduced("SUM", (3,), torch.float32)), f"rank {rank}, mixed: {mixed}"
        if sent:
            sent.wait()
        else:
            received = stale((3, 5))
            dist.recv(received, src=0)
            expect("recv after the all_reduce", received, values(0, (3, 5)))
    finally:
        staging.writable = writable
    if staging.zero_copy():
        assert not copies, f"rank {rank}: the all-reduce copied its operand on the host"


@check
def object_collectives(rank):
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {"rank": rank, "items": list(range(rank + 3))})
    assert gathered == [{"rank": r, "items": list(range(r + 3))} for r in range(WORLD)], gathered
    objects = [f"from {rank}", rank * 10] if rank == 1 else [None, None]
    dist.broadcast_object_list(objects, src=1)
    assert objects == ["from 1", 10], objects


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


STAGING = {"zero-copy": True, "copies": False}  # PJRT CPU's path, and the TPU side channel's


def rank_main() -> None:
    """One rank: join the ``xla_host`` world and run every check in order, for each way of staging."""
    dist.init_process_group(backends.register_backend("xla_host", host_addressable=True), timeout=TIMEOUT)
    rank = dist.get_rank()
    for name, zero_copy in STAGING.items():
        staging.configure(zero_copy)
        for fn in CHECKS:
            fn(rank)
            print(f"PASS {name} {fn.__name__}", flush=True)
    dist.destroy_process_group()


IN_PLACE = ("SUM", "MAX", "MIN", "PRODUCT")  # every value of a product of 3 ranks' is exact in bf16 up to its last step


def in_place_reductions(rank: int) -> None:
    """All-reduces of more than two ranks: gloo reduces a writable copy of each operand in place."""
    for dtype in DTYPES:
        for shape in ((),) + SHAPES:
            for op in IN_PLACE:
                tensor = xla(values(rank, shape, dtype))
                dist.all_reduce(tensor, op=REDUCE[op][0])
                expect(f"all_reduce {op} {dtype} {shape}", tensor, reduced(op, shape, dtype))
        for op in IN_PLACE:
            tensors = [xla(values(rank, shape, dtype, salt)) for salt, shape in enumerate(SHAPES)]
            dist.all_reduce_coalesced(tensors, op=REDUCE[op][0])
            for salt, (shape, tensor) in enumerate(zip(SHAPES, tensors)):
                expect(f"all_reduce_coalesced {op} {dtype} {shape}", tensor, reduced(op, shape, dtype, salt))


def three_rank_main() -> None:
    """One of three ranks: the in-place reductions, for each way of staging."""
    dist.init_process_group(backends.register_backend("xla_host", host_addressable=True), timeout=TIMEOUT)
    for name, zero_copy in STAGING.items():
        staging.configure(zero_copy)
        in_place_reductions(dist.get_rank())
        print(f"PASS {name} in_place_reductions", flush=True)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(f"{__name__}:rank_main", WORLD)


@pytest.fixture(scope="module")
def three_ranks():
    return run_ranks(f"{__name__}:three_rank_main", 3)


@pytest.mark.parametrize("name", [fn.__name__ for fn in CHECKS])
@pytest.mark.parametrize("staging", list(STAGING))
def test_collective(ranks, staging, name):
    for rank, proc in enumerate(ranks):
        if f"PASS {staging} {name}" not in proc.stdout.splitlines():
            pytest.fail(f"rank {rank} (exit code {proc.returncode}) did not pass {name} ({staging}):\n"
                        f"{proc.stderr[-6000:]}")


@pytest.mark.parametrize("staging", list(STAGING))
def test_reductions_of_three_ranks_in_place(three_ranks, staging):
    for rank, proc in enumerate(three_ranks):
        assert f"PASS {staging} in_place_reductions" in proc.stdout.splitlines(), (
            f"rank {rank} (exit code {proc.returncode}):\n{proc.stderr[-6000:]}")
    assert [proc.returncode for proc in three_ranks] == [0, 0, 0]


def test_ranks_exit_cleanly(ranks):
    for rank, proc in enumerate(ranks):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{proc.stderr[-6000:]}"
