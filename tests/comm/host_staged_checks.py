"""The rank side of ``test_host_staged.py``: what the checks share (operands whose results are exact, and the
comparison on the XLA device), and one check of each collective torch.distributed offers, registered in order into
``CHECKS``; the three-rank reductions in place."""
import math
from datetime import timedelta
from typing import Callable, List, Tuple

import torch
import torch.distributed as dist

from deepspeed_xla.comm import staging

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
