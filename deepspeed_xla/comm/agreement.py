"""Every rank of a group passes a collective tensors of the same dtypes and sizes: checked before gloo runs it.

gloo cannot tell a disagreement from a dead peer: a rank that receives more bytes than its operand holds is aborted
from gloo's I/O thread (``op.preamble.length <= op.nbytes``), one that receives fewer reduces a partial buffer, and a
dtype of the same width mixes unrelated bits. So each rank sends the other members of the group a signature of
each collective (the op, its root or reduction, its tensors' dtypes and shapes) and compares theirs with its own
before running it: on a mismatch every member raises the same error, naming the op, the ranks and their tensors.

One message per peer each time the issued queue runs (``work.Issued.run``), not one per op. A rank's queue may run
at other points than its peers' (one rank waits on each op, another on the last), so signatures are a stream per
pair of ranks: a batch's signatures are sent when it starts and a peer's are read as the ops need them, which waits
no longer than the op itself would have. Host-side, on CPU tensors: no XLA execution, no transfer.
"""
import collections
import contextlib
import math
import re
import struct
from typing import Deque, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from deepspeed_xla.comm import watchdog
from deepspeed_xla.comm.work import wait_all

TAG = (1 << 30) + 1  # apart from the users' sends and receives and from the two-rank all-reduce's swap
CHUNK = 1 << 16  # bytes of one message; a batch with more signatures sends the rest in a second one
_HEADER = struct.Struct("<qq")  # the signatures' length in bytes, the sender's global rank
_SHAPE = re.compile(r"\[([0-9,]*)\]")


def describe(tensors: Sequence[torch.Tensor]) -> str:
    """``float32[3,5],int64[]``: what a peer must pass as well."""
    return ",".join(f"{str(t.dtype).removeprefix('torch.')}[{','.join(map(str, t.shape))}]" for t in tensors)


def signature(op: str, tensors: Sequence[torch.Tensor], results: Sequence[torch.Tensor] = (), detail: str = "",
              sizes: bool = True) -> str:
    """The signature of collective ``op`` (torch.distributed's name), from tensors every member passes: ``tensors``
    and ``results``; ``detail``: a root or reduction the members must agree on; ``sizes``: False where members
    legitimately pass different sizes (all-to-all), only dtypes are compared."""
    head = f"{op}({detail})" if detail else op
    if not sizes:
        return f"{head} {','.join(str(t.dtype).removeprefix('torch.') for t in tensors)}"
    return f"{head} {describe(tensors)}" + (f" -> {describe(results)}" if results else "")


def _layout(signature_: str) -> str:
    """A signature with each shape replaced by its element count: gloo reads a [4] and a [2,2] alike."""
    return _SHAPE.sub(lambda m: f"[{math.prod(int(d) for d in m.group(1).split(',') if d)}]", signature_)


class Agreement:
    """The signature streams between this rank and the other members of one gloo group."""

    def __init__(self, gloo: dist.ProcessGroup, rank: int, size: int):
        self._gloo, self._rank = gloo, rank
        self._peers = [peer for peer in range(size) if peer != rank]
        self._received: Dict[int, Deque[str]] = {peer: collections.deque() for peer in self._peers}
        self._names: Dict[int, int] = {}  # group rank -> global rank, as each peer sent it
        self._inboxes: Dict[int, Tuple[torch.Tensor, memoryview]] = {}  # peer -> where its next message lands
        # peer -> the receive of its next message, posted as soon as the last one arrived: gloo sends only to a
        # receive the peer has posted, and one posted early spares a round trip to ask for the message.
        self._posted: Dict[int, dist.Work] = {}
        # The last batch's sends. gloo sends once the peer receives: every peer has received the batch's signatures
        # by the time it ran the batch's first op with this rank, so these are done when the next batch starts.
        self._sending: List[dist.Work] = []

    def _global_rank(self) -> int:
        """What the error calls this rank: its rank in the world, when there is one."""
        return dist.get_rank() if dist.is_initialized() else self._rank

    def announce(self, signatures: Sequence[str]) -> None:
        """Send the signatures of the ops this rank is about to run, in order, to every other member."""
        payload = "\n".join(signatures).encode()
        message = _HEADER.pack(len(payload), self._global_rank()) + payload
        parts = [torch.frombuffer(bytearray(part), dtype=torch.uint8) for part in (message[:CHUNK], message[CHUNK:])
                 if part]
        wait_all(self._sending)
        try:
            self._sending = [self._gloo.send([part], peer, TAG) for peer in self._peers for part in parts]
        except RuntimeError as error:  # gloo refuses at once to start on a connection a dead peer closed
            watchdog.explain_failure(error)

    def _post(self, peer: int) -> dist.Work:
        """The receive of ``peer``'s next message."""
        if peer not in self._inboxes:
            inbox = torch.empty(CHUNK, dtype=torch.uint8, device="cpu")  # "cpu": zero.Init moves bare ones
            self._inboxes[peer] = inbox, memoryview(inbox.numpy())
        return self._gloo.recv([self._inboxes[peer][0]], peer, TAG)

    def _receive(self, peer: int) -> None:
        posted = self._posted.pop(peer, None)
        if posted is None:
            try:
                posted = self._post(peer)
            except RuntimeError as error:  # gloo refuses at once to start on a connection a dead peer closed
                watchdog.explain_failure(error)
        wait_all(posted)
        view = self._inboxes[peer][1]
        length, self._names[peer] = _HEADER.unpack_from(view)
        payload = view[_HEADER.size:min(_HEADER.size + length, CHUNK)].tobytes()  # what the first message held
        if len(payload) < length:
            rest = torch.empty(length - len(payload), dtype=torch.uint8, device="cpu")
            wait_all(self._gloo.recv([rest], peer, TAG))
            payload += rest.numpy().tobytes()
        self._received[peer].extend(payload.decode().split("\n"))
        with contextlib.suppress(RuntimeError):  # a peer that ended after its last collective: no next message
            self._posted[peer] = self._post(peer)

    def _next(self, peer: int) -> str:
        if not self._received[peer]:
            self._receive(peer)
        return self._received[peer].popleft()

    def agree(self, mine: str) -> None:
        """Before running the op whose signature is ``mine``: every other member's next op must match it in dtypes
        and sizes. Raises the same error on every member otherwise."""
        every = {peer: self._next(peer) for peer in self._peers}
        if all(theirs == mine for theirs in every.values()) or all(
                _layout(theirs) == _layout(mine) for theirs in every.values()):
            return
        for queue in self._received.values():  # the rest of each member's batch: it will not run there either
            queue.clear()
        every[self._rank] = mine
        self._names[self._rank] = self._global_rank()
        passed = "; ".join(f"rank {self._names[r]}: {every[r]}" for r in sorted(every))
        ops = sorted({s.partition(" ")[0].partition("(")[0] for s in every.values()})
        raise RuntimeError(
            f"deepspeed_xla: the ranks of a group passed {' / '.join(ops)} different tensors ({passed}). Every rank "
            f"must pass each collective tensors of the same dtypes and sizes, in the same order of collectives; gloo "
            f"would abort a rank, or return partial or garbled results. The collectives issued with it do not run.")
