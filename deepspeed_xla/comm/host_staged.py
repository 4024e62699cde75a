"""``xla_host``: a torch.distributed backend that runs collectives on XLA tensors through host memory.

PJRT CPU has no cross-process XLA collectives, and gloo handed XLA tensors silently does nothing or
hangs. This process group materializes the XLA operands (one execution for all of them), runs the
op with gloo on host memory, and writes the results back into the XLA tensors (``staging``); CPU
tensors go to gloo directly. Between two ranks an all-reduce swaps operands instead of reducing in
place (``_pairwise``). Everything above torch.distributed (DeepSpeed's comm layer, ZeRO, the pipeline
engine) runs the same code as on TPU, where the ``xla_ds`` backend is used instead.

Collectives are queued and run when waited on (``work``). Sends and receives start at once and run
until their Work is waited on, so paired isend/irecv do not deadlock. Subgroups work as usual:
``new_group`` calls the creator again with the group's own store. gloo's timeout is the group's, or
``DS_XLA_COMM_TIMEOUT``; a failed gloo op names the failed rank (``watchdog``). Before a collective runs, the
members check that they pass it tensors of the same dtypes and sizes (``agreement``).
"""
import functools
import os
from datetime import timedelta
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ProcessGroup

from deepspeed_xla.comm import accounting, gloo_output, host_buffers, staging, watchdog
from deepspeed_xla.comm.agreement import Agreement, describe, signature
from deepspeed_xla.comm.hang_report import Wait
from deepspeed_xla.comm.work import ISSUED, HostWork, PendingWork, completed_work as _done, wait_all

BACKEND_NAME = "xla_host"
_GLOO_LAZY = "TORCH_GLOO_LAZY_INIT"


def _flatten(lists: Sequence[Sequence[torch.Tensor]]) -> List[torch.Tensor]:
    return [t for inner in lists for t in inner]


def _unflatten(flat: Sequence[torch.Tensor], like: Sequence[Sequence[torch.Tensor]]) -> List[List[torch.Tensor]]:
    it = iter(flat)
    return [[next(it) for _ in inner] for inner in like]


def _as_1d(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """1-d views: gloo's tensor collectives take only the concatenated layout, torch also the stacked one."""
    return [t.view(-1) for t in tensors]


# Elementwise reductions that give both ranks of a pair the same result from each other's whole operand.
_PAIRWISE = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum,
             dist.ReduceOp.PRODUCT: torch.mul}
_PAIRWISE_TAG = 1 << 30  # apart from the users' sends and receives (tag 0 by default) that may be in flight


def _reduction(op: dist.ReduceOp) -> str:
    return op.op.name


def _gloo_group(store, rank: int, size: int, timeout: timedelta, lazy: bool) -> dist.ProcessGroupGloo:
    """A gloo group, its connection lines held back (``gloo_output``); ``lazy`` connects each pair of ranks when
    they first talk, not all pairs up front.

    gloo reads ``TORCH_GLOO_LAZY_INIT`` when a group is built and has no constructor argument for it.
    """
    previous = os.environ.get(_GLOO_LAZY)
    if lazy:
        os.environ[_GLOO_LAZY] = "1"
    try:
        with gloo_output.held_back(rank):
            return dist.ProcessGroupGloo(store, rank, size, timeout)
    finally:
        if lazy and previous is None:
            del os.environ[_GLOO_LAZY]
        elif lazy:
            os.environ[_GLOO_LAZY] = previous


@accounting.instrument
class HostStagedProcessGroup(ProcessGroup):
    """Collectives for XLA tensors over gloo, staged through host memory."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, connect_on_first_use: bool = False):
        super().__init__(rank, size)
        self._gloo = _gloo_group(store, rank, size, timeout, connect_on_first_use)
        self._agreement = Agreement(self._gloo, rank, size)
        self._global_ranks: Optional[Tuple[int, ...]] = None

    def wait_in(self, op: str) -> Wait:
        """What a rank waiting in collective ``op`` (its signature) of this group waits in: the hang report's words.
        torch registers this object as the group itself (``_world.pg_group_ranks``), once it is built."""
        if self._global_ranks is None:
            try:
                self._global_ranks = tuple(dist.get_process_group_ranks(self))
            except (KeyError, RuntimeError, ValueError):  # not registered yet: during torch's own set-up
                return Wait(op, ())
        return Wait(op, self._global_ranks)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self):
        return self._group_name

    def announce(self, signatures: List[str]) -> None:
        """The signatures of this group's issued collectives about to run (``work.Issued.run``)."""
        self._agreement.announce(signatures)

    def agree(self, signature_: str) -> None:
        """Before a collective runs: raises unless every member passes the same (``agreement``)."""
        self._agreement.agree(signature_)

    def _start(self, inputs, outputs, call, op: str) -> HostWork:
        """Run the issued collectives, then stage ``inputs`` and start ``call`` (sends and receives: ``op``)."""
        ISSUED.run()
        return self._launch(inputs, staging.to_host(inputs), outputs, call, collective=self.wait_in(op))

    def _launch(self, inputs, host_in, outputs, call, in_place: bool = True, collective=None) -> HostWork:
        """Start ``call(host_in, host_out)`` on gloo, ``host_in`` being ``inputs`` staged; wait writes
        ``outputs`` back; ``collective``: what waiting on it waits in, if not the running collective.

        An output that is also an input starts from its staged data with ``in_place``, else it gets a
        host buffer of its own; pure outputs get fresh host buffers. ``call`` returns the gloo Work, or a
        list of them.
        """
        staged = {id(t): host for t, host in zip(inputs, host_in)}

        def output_buffer(tensor):
            if id(tensor) not in staged:
                return staging.host_buffer(tensor)
            if not in_place:
                return host_buffers.empty(tensor.shape, tensor.dtype)
            return staging.writable(staged[id(tensor)]) if staging.is_xla(tensor) else staged[id(tensor)]

        host_out = [output_buffer(t) for t in outputs]
        try:
            works = call(host_in, host_out)
        except RuntimeError as error:  # gloo refuses at once to start on a connection a dead peer closed
            watchdog.explain_failure(error)
        return HostWork(works, outputs, host_out, collective)

    def _run(self, inputs, outputs, call, signature_: str, in_place: bool = True) -> dist.Work:
        """Issue a collective; it runs when waited on (``work.Issued``). ``signature_``: what every member passes it
        (``agreement.signature``); ``in_place``: see ``_launch``.

        A one-rank group copies on the device instead: staging would cut the step's graph for nothing.
        """
        if self.size() == 1:
            ISSUED.before_now(inputs, outputs)
            staging.copy_local(inputs, outputs)
            return _done(list(outputs))
        work = PendingWork(self, inputs, outputs, call, in_place, signature_)
        ISSUED.add(work)
        return work

    # coalescing: torch runs the recorded ops through the *_coalesced methods below
    def _start_coalescing(self, device: torch.device) -> None:
        """Nothing to start; the C++ default looks for a per-device backend, which a Python group lacks."""

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        """torch keeps this Work, not the coalesced op's, when a device is given: run the op now."""
        ISSUED.run()
        return _done()

    # all-reduce family
    def allreduce(self, tensors, opts):
        return self._allreduce("all_reduce", tensors, opts.reduceOp, lambda out: self._gloo.allreduce(out, opts))

    def allreduce_coalesced(self, tensors, opts):
        """One all-reduce per tensor (gloo's coalesced one needs a single dtype), staged together."""
        all_opts = dist.AllreduceOptions()
        all_opts.reduceOp = opts.reduceOp
        return self._allreduce("all_reduce_coalesced", tensors, opts.reduceOp,
                               lambda out: [self._gloo.allreduce([t], all_opts) for t in out])

    def _allreduce(self, name: str, tensors, op, on_gloo: Callable) -> dist.Work:
        """Between two ranks where staging is zero-copy, swap operands (``_pairwise``); else ``on_gloo(host
        buffers)``. The choice never depends on a rank's tensors, so both ranks of a pair make the same."""
        combine, signed = _PAIRWISE.get(op.op), signature(name, tensors, detail=_reduction(op))
        if self.size() == 2 and combine is not None and staging.zero_copy():
            return self._run(tensors, tensors, functools.partial(self._pairwise, combine), signed, in_place=False)
        return self._run(tensors, tensors, lambda _, out: on_gloo(out), signed)

    def _pairwise(self, combine: Callable, host_in, host_out) -> dist.Work:
        """All-reduce of two ranks: swap operands whole, then combine the peer's with our own.

        gloo reduces in place, and a zero-copy operand is read-only: the in-place path copies each
        operand first (docs/performance.md, "Figures behind the code"). The swap moves as many bytes as
        gloo's ring on two ranks, and both ranks compute ``combine`` of the same two values, so they agree.
        """
        peer = 1 - self.rank()
        works = [work for mine, theirs in zip(host_in, host_out) for work in
                 (self._gloo.send([mine], peer, _PAIRWISE_TAG), self._gloo.recv([theirs], peer, _PAIRWISE_TAG))]
        wait_all(works)
        for mine, theirs in zip(host_in, host_out):
            combine(theirs, mine, out=theirs)
        return _done()

    def reduce(self, tensors, opts):
        """Only the root's tensors change: gloo scribbles on the others' buffers, which stay on the host."""
        outputs = tensors if self.rank() == opts.rootRank else []
        return self._run(tensors, outputs, lambda i, o: self._gloo.reduce(o or [staging.writable(t) for t in i], opts),
                         signature("reduce", tensors, detail=f"{_reduction(opts.reduceOp)}, root {opts.rootRank}"))

    def broadcast(self, tensors, opts):
        inputs = tensors if self.rank() == opts.rootRank else []
        return self._run(inputs, tensors, lambda _, out: self._gloo.broadcast(out, opts),
                         signature("broadcast", tensors, detail=f"root {opts.rootRank}"))

    # gather family
    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or AllgatherOptions()
        flat = _flatten(output_lists)
        return self._run(inputs, flat, lambda i, o: self._gloo.allgather(_unflatten(o, output_lists), i, opts),
                         signature("all_gather", inputs, flat))

    def _allgather_base(self, output, input, opts=None):
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or AllgatherOptions()
        return self._run(inputs, outputs, lambda i, o: [
            self._gloo._allgather_base(out, inp, opts) for out, inp in zip(_as_1d(o), _as_1d(i))],
            signature("all_gather_into_tensor", inputs, outputs))

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        opts = opts or AllgatherOptions()
        flat = _flatten(output_lists)
        return self._run(inputs, flat,
                         lambda i, o: self._gloo.allgather_coalesced(_unflatten(o, output_lists), i, opts),
                         signature("all_gather_coalesced", inputs, flat))

    def gather(self, output_lists, inputs, opts):
        flat = _flatten(output_lists)
        return self._run(inputs, flat, lambda i, o: self._gloo.gather(_unflatten(o, output_lists), i, opts),
                         signature("gather", inputs, detail=f"root {opts.rootRank}"))

    # scatter family
    def reduce_scatter(self, outputs, input_lists, opts):
        flat = _flatten(input_lists)
        return self._run(flat, outputs, lambda i, o: self._gloo.reduce_scatter(o, _unflatten(i, input_lists), opts),
                         signature("reduce_scatter", flat, outputs, detail=_reduction(opts.reduceOp)))

    def _reduce_scatter_base(self, output, input, opts):
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run(inputs, outputs, lambda i, o: [
            self._gloo._reduce_scatter_base(out, inp, opts) for out, inp in zip(_as_1d(o), _as_1d(i))],
            signature("reduce_scatter_tensor", inputs, outputs, detail=_reduction(opts.reduceOp)))

    def scatter(self, outputs, input_lists, opts):
        flat = _flatten(input_lists)
        return self._run(flat, outputs, lambda i, o: self._gloo.scatter(o, _unflatten(i, input_lists), opts),
                         signature("scatter", outputs, detail=f"root {opts.rootRank}"))

    # all-to-all
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        return self._run([input], [output], lambda i, o: self._gloo.alltoall_base(
            o[0], i[0], output_split_sizes, input_split_sizes, opts),
            signature("all_to_all_single", [input, output], sizes=False))

    def alltoall(self, outputs, inputs, opts):
        return self._run(inputs, outputs, lambda i, o: self._alltoall_host(o, i, opts),
                         signature("all_to_all", [*inputs, *outputs], sizes=False))

    def _alltoall_host(self, outputs, inputs, opts):
        """gloo has no list all-to-all: one alltoall_base between flat buffers split by numel."""
        out_sizes = [t.numel() for t in outputs]
        flat_out = host_buffers.empty((sum(out_sizes),), outputs[0].dtype)
        wait_all(self._gloo.alltoall_base(flat_out, torch.cat(_as_1d(inputs)), out_sizes, [t.numel() for t in inputs],
                                       opts))
        for output, chunk in zip(outputs, flat_out.split(out_sizes)):
            output.copy_(chunk.view_as(output))
        return _done()

    # point to point: left running, or two ranks that both isend before they irecv would deadlock
    def send(self, tensors, dst, tag=0):
        return self._start(tensors, [], lambda i, _: self._gloo.send(i, dst, tag), f"send(to {dst}) "
                           f"{describe(tensors)}")

    def recv(self, tensors, src, tag=0):
        return self._start([], tensors, lambda _, o: self._gloo.recv(o, src, tag), f"recv(from {src}) "
                           f"{describe(tensors)}")

    def recv_anysource(self, tensors, tag=0):
        return self._start([], tensors, lambda _, o: self._gloo.recv_anysource(o, tag), f"recv(from any) "
                           f"{describe(tensors)}")

    def barrier(self, opts=None):
        ISSUED.run()
        with watchdog.in_collective(self.wait_in("barrier")):
            wait_all(self._gloo.barrier(opts or dist.BarrierOptions()))
        return _done()

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self.barrier()


@watchdog.watched
def _create(store, rank, size, timeout):
    return HostStagedProcessGroup(store, rank, size, timeout)


def register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "xla"])
