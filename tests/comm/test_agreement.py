"""``comm/agreement.py``: the signature streams between the members of a group, over an in-memory stand-in for gloo
(two real ranks disagreeing: ``test_host_staged.py``, check ``disagreeing_ranks_raise``)."""
import collections

import pytest
import torch

from deepspeed_xla.comm import agreement, work

F32 = torch.float32


class _Wire:
    """Stands in for the gloo groups of two ranks: sends queue a copy per (source, destination, tag); a receive
    takes the oldest, refusing one larger than its buffer as gloo does (``op.preamble.length <= op.nbytes``)."""

    def __init__(self):
        self.queues = collections.defaultdict(collections.deque)
        self.messages = 0

    def rank(self, rank: int) -> "_Gloo":
        return _Gloo(self, rank)


class _Gloo:
    def __init__(self, wire: _Wire, rank: int):
        self.wire, self.me = wire, rank

    def send(self, tensors, peer, tag):
        self.wire.queues[self.me, peer, tag].append(tensors[0].clone())
        self.wire.messages += 1
        return work.completed_work()

    def recv(self, tensors, peer, tag):
        return _Receive(self.wire.queues[peer, self.me, tag], tensors[0], f"rank {self.me} from rank {peer}")


class _Receive:
    """A posted receive: the message lands when waited on."""

    def __init__(self, queue, buffer: torch.Tensor, what: str):
        self.queue, self.buffer, self.what = queue, buffer, what

    def wait(self) -> bool:
        assert self.queue, f"{self.what}: would wait forever for signatures never sent"
        message = self.queue.popleft()
        assert message.numel() <= self.buffer.numel(), "gloo aborts: a message larger than the receive buffer"
        self.buffer[:message.numel()] = message
        return True


def _pair():
    wire = _Wire()
    return wire, [agreement.Agreement(wire.rank(r), r, 2) for r in range(2)]


def _all_reduce(*shape, dtype=F32) -> str:
    return agreement.signature("all_reduce", [torch.empty(shape, dtype=dtype)], detail="SUM")


def test_ranks_that_run_the_same_ops_in_other_batches_agree(monkeypatch):
    """Rank 0 runs each op as it is issued, rank 1 all of them at once, in messages cut at a small ``CHUNK`` (after
    the receive buffers were made, larger): each rank reads the other's signatures as its ops need them, and never
    waits for a later batch."""
    wire, (first, second) = _pair()
    for member in (first, second):
        member.announce([_all_reduce(1)])
    for member in (first, second):
        member.agree(_all_reduce(1))
    monkeypatch.setattr(agreement, "CHUNK", 64)
    wire.messages = 0
    ops = [_all_reduce(n) for n in range(1, 9)]
    second.announce(ops)
    for op in ops:
        first.announce([op])
        first.agree(op)
        second.agree(op)
    assert wire.messages == len(ops) + 2, "rank 1's batch is not its first CHUNK bytes, then the rest"
    assert not any(wire.queues.values()), "a signature was sent and never compared"


def test_the_same_bytes_in_another_shape_agree():
    """gloo moves the bytes of a [4] and a [2, 2] alike: torch.distributed accepts both, so must this."""
    _, (first, second) = _pair()
    first.announce([_all_reduce(4)])
    second.announce([_all_reduce(2, 2)])
    first.agree(_all_reduce(4))
    second.agree(_all_reduce(2, 2))


@pytest.mark.parametrize("theirs", [_all_reduce(8), _all_reduce(2), _all_reduce(4, dtype=torch.int32),
                                    agreement.signature("broadcast", [torch.empty(4)], detail="root 0")],
                         ids=["larger", "smaller", "dtype", "op"])
def test_a_mismatch_raises_the_same_error_on_both_ranks(theirs):
    _, (first, second) = _pair()
    mine = _all_reduce(4)
    first.announce([mine])
    second.announce([theirs])
    errors = []
    for member, signature in ((first, mine), (second, theirs)):
        with pytest.raises(RuntimeError, match="the same dtypes and sizes") as raised:
            member.agree(signature)
        errors.append(str(raised.value))
    assert errors[0] == errors[1], errors
    assert f"rank 0: {mine}; rank 1: {theirs}" in errors[0], errors[0]


def test_collectives_after_a_mismatch_agree_again():
    """The ops issued with a mismatched one never run on any member: their signatures are dropped with it."""
    _, (first, second) = _pair()
    first.announce([_all_reduce(4), _all_reduce(3)])
    second.announce([_all_reduce(8), _all_reduce(5)])
    for member, signature in ((first, _all_reduce(4)), (second, _all_reduce(8))):
        with pytest.raises(RuntimeError, match="different tensors"):
            member.agree(signature)
    for member in (first, second):
        member.announce([_all_reduce(2)])
    for member in (first, second):
        member.agree(_all_reduce(2))


def test_signatures_name_what_every_member_passes():
    tensors = [torch.empty(3, 5), torch.empty((), dtype=torch.bfloat16)]
    assert agreement.signature("all_gather", tensors[:1], [torch.empty(3, 5)] * 2) == \
        "all_gather float32[3,5] -> float32[3,5],float32[3,5]"
    assert agreement.signature("reduce", tensors, detail="SUM, root 1") == "reduce(SUM, root 1) float32[3,5],bfloat16[]"
    assert agreement.signature("all_to_all_single", tensors, sizes=False) == "all_to_all_single float32,bfloat16"


def test_receive_buffers_stay_on_the_host_inside_zero_init(monkeypatch, xla_device):
    """Inside ``deepspeed.zero.Init`` a tensor made without a device lands on the accelerator (DeepSpeed's own
    constructor wrapper), and a ZeRO-3 model being built there broadcasts its parameters: the signature streams'
    receive buffers, a batch's first message and its rest, must still be host memory that numpy reads."""
    from deepspeed.runtime.zero.partition_parameters import zero_wrapper_for_fp_tensor_constructor
    ops = [_all_reduce(n) for n in range(1, 9)]
    monkeypatch.setattr(torch, "empty", zero_wrapper_for_fp_tensor_constructor(torch.empty, F32, xla_device))
    assert torch.empty(1, dtype=torch.uint8).device == xla_device
    monkeypatch.setattr(agreement, "CHUNK", 64)
    wire, (first, second) = _pair()
    for member in (first, second):
        member.announce(ops)
    for op in ops:
        first.agree(op)
        second.agree(op)
    assert wire.messages == 4  # each rank's batch: its first CHUNK bytes, then the rest
