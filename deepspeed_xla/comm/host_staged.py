"""``xla_host``: a torch.distributed backend that runs collectives on XLA tensors through host memory.

PJRT CPU has no cross-process XLA collectives, and gloo handed XLA tensors silently does nothing or
hangs. This process group materializes the XLA operands (one execution for all of them), runs the
op with gloo on host memory, and writes the results back into the XLA tensors; CPU tensors go to
gloo directly. On PJRT CPU, where device buffers are host memory, nothing crosses a device boundary:
gloo reads the XLA buffers through DLPack, and each result reaches its XLA tensor as a copy from an
XLA alias of gloo's buffer inside the next graph (for a whole tensor, torch_xla just adopts the
buffer). An in-place operand is copied once on the host first, since XLA buffers must not change;
large buffers are reused (``host_buffers``); between two ranks an all-reduce needs no such copy
(``_pairwise``). Elsewhere (the TPU side channel) the operands are
copied to host memory and back. Everything above torch.distributed (DeepSpeed's comm layer, ZeRO,
the pipeline engine) runs the same code as on TPU, where the ``xla`` backend is used instead.

Subgroups work as usual: ``new_group`` calls the creator again with the group's own store.
gloo's timeout is the group's, or ``DS_XLA_COMM_TIMEOUT``; a failed gloo op names the failed rank
(``comm/watchdog.py``).
A collective runs when its Work is waited on (at once for a blocking call), together with every
collective issued before it: every rank issues them in the same order, so running them in that order
keeps each group's sequence, and their XLA operands are staged together in one execution (ZeRO-3
issues one asynchronous all-gather per parameter and waits on them all). Sends and receives start at
once and run until their Work is waited on, so paired isend/irecv do not deadlock.
"""
import functools
import os
from datetime import timedelta
from typing import Callable, List, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ProcessGroup

from deepspeed_xla import xla_runtime
from deepspeed_xla.comm import completed_work as _done
from deepspeed_xla.comm import host_buffers, watchdog

BACKEND_NAME = "xla_host"
_GLOO_LAZY = "TORCH_GLOO_LAZY_INIT"


def _is_xla(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "xla"


@functools.lru_cache(maxsize=None)
def _zero_copy() -> bool:
    """Device buffers are host memory (PJRT CPU): gloo reads them in place and fills buffers XLA adopts."""
    from deepspeed_xla.devices import current_device_type
    return current_device_type().host_addressable


def _to_host(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Host tensors for ``tensors``: CPU ones as they are, XLA ones with one execution, then views or copies."""
    xla = [t for t in tensors if _is_xla(t)]
    if not xla:
        return list(tensors)
    hosts = iter(xla_runtime.host_views(xla) if _zero_copy() else xla_runtime.to_host(xla))
    return [next(hosts) if _is_xla(t) else t for t in tensors]


def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """Where gloo writes a pure output: host memory of its own, so the device data is never read."""
    return host_buffers.empty(tensor.shape, tensor.dtype) if _is_xla(tensor) else tensor


def _writable(staged: torch.Tensor) -> torch.Tensor:
    """An in-place operand's host buffer: a view of an XLA buffer is read-only, gloo writes a copy."""
    return host_buffers.empty(staged.shape, staged.dtype).copy_(staged) if _zero_copy() else staged


def _write_back(targets: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor]) -> None:
    """Like a backend writing device memory: no autograd (targets may be parameters, e.g. tied weights).

    Zero-copy, the source is an XLA alias of the host buffer: the copy joins the next graph (and reaches
    the target's views and base like any in-place op) instead of being a host-to-device transfer.
    """
    with torch.no_grad():
        for target, host in zip(targets, hosts):
            if target is not host:
                target.copy_(xla_runtime.device_alias(host) if _zero_copy() and _is_xla(target) else host)


def _copy_local(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    """Any collective of a one-rank group: each output is its input (in place, or a copy in the output's shape)."""
    assert len(inputs) == len(outputs), "a one-rank collective pairs each input with one output"
    with torch.no_grad():
        for target, source in zip(outputs, inputs):
            if target is not source:
                target.copy_(source.reshape(target.shape))


def _wait(works) -> None:
    try:
        for work in works if isinstance(works, (list, tuple)) else [works]:
            work.wait()
    except RuntimeError as error:  # gloo: a peer closed the connection, or the timeout passed
        watchdog.explain_failure(error)


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


def _gloo_group(store, rank: int, size: int, timeout: timedelta, lazy: bool) -> dist.ProcessGroupGloo:
    """A gloo group; ``lazy`` connects each pair of ranks when they first talk, not all pairs up front.

    gloo reads ``TORCH_GLOO_LAZY_INIT`` when a group is built and has no constructor argument for it.
    """
    if not lazy:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    previous = os.environ.get(_GLOO_LAZY)
    os.environ[_GLOO_LAZY] = "1"
    try:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    finally:
        if previous is None:
            del os.environ[_GLOO_LAZY]
        else:
            os.environ[_GLOO_LAZY] = previous


def _alias_key(tensor: torch.Tensor) -> int:
    """Tensors with the same key may share memory: a view is keyed by its base."""
    return id(tensor._base if tensor._base is not None else tensor)


class _Issued:
    """Collectives issued and not yet run, in issue order, over all groups of this process."""

    def __init__(self):
        self.ops: List["_PendingWork"] = []
        self.read, self.written = set(), set()

    def _run_if_any(self, tensors: Sequence[torch.Tensor], keys: set) -> None:
        if any(_alias_key(t) in keys for t in tensors):
            self.run()

    def add(self, work: "_PendingWork") -> None:
        """Queue ``work``. Queued ops stage all their inputs before any writes back, so only an op that
        reads what a queued op writes must wait for the queue to run."""
        self._run_if_any(work.inputs, self.written)
        self.ops.append(work)
        self.read.update(_alias_key(t) for t in work.inputs)
        self.written.update(_alias_key(t) for t in work.outputs)

    def before_now(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Before an op that runs at once: run the queue if the op reads what it writes, or writes what it
        reads or writes (issued later, the op must see the queue's results and not change its inputs)."""
        self._run_if_any(inputs, self.written)
        self._run_if_any(outputs, self.read | self.written)

    def run(self) -> None:
        """Stage every queued op's operands at once, then run the ops in order."""
        ops, self.ops, self.read, self.written = self.ops, [], set(), set()
        staged = iter(_to_host([t for op in ops for t in op.inputs]))
        for op in ops:
            op.run([next(staged) for _ in op.inputs])


_ISSUED = _Issued()


class _PendingWork(dist.Work):
    """A collective queued in ``_ISSUED``: waiting on it runs it and everything issued before it."""

    def __init__(self, group: "HostStagedProcessGroup", inputs, outputs, call: Callable, in_place: bool):
        super().__init__()
        self.group, self.inputs, self.outputs, self.call = group, list(inputs), list(outputs), call
        self.in_place, self.done = in_place, False

    def run(self, host_in: List[torch.Tensor]) -> None:
        self.group._launch(self.inputs, host_in, self.outputs, self.call, self.in_place).wait()
        self.done = True

    def _finish(self) -> None:
        if not self.done:
            _ISSUED.run()

    def wait(self, timeout=None) -> bool:
        self._finish()
        return True

    def is_completed(self) -> bool:
        self._finish()
        return True

    def result(self) -> List[torch.Tensor]:
        self._finish()
        return self.outputs

    def get_future(self) -> torch.futures.Future:
        self._finish()
        future = torch.futures.Future()
        future.set_result(self.outputs)
        return future


class _HostWork(dist.Work):
    """A gloo op on host buffers; ``wait`` finishes it and writes the results into the XLA tensors."""

    def __init__(self, works, outputs: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor]):
        super().__init__()
        self._works, self._outputs, self._hosts = works, list(outputs), list(hosts)

    def wait(self, timeout=None) -> bool:
        """``timeout`` is the group's, as gloo applies it."""
        _wait(self._works)
        _write_back(self._outputs, self._hosts)
        self._outputs = self._hosts = []
        return True

    def _source_rank(self) -> int:
        return self._works._source_rank()


class HostStagedProcessGroup(ProcessGroup):
    """Collectives for XLA tensors over gloo, staged through host memory."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, connect_on_first_use: bool = False):
        super().__init__(rank, size)
        self._gloo = _gloo_group(store, rank, size, timeout, connect_on_first_use)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self):
        return self._group_name

    def _start(self, inputs, outputs, call) -> _HostWork:
        """Run the issued collectives, then stage ``inputs`` and start ``call`` (sends and receives)."""
        _ISSUED.run()
        return self._launch(inputs, _to_host(inputs), outputs, call)

    def _launch(self, inputs, host_in, outputs, call, in_place: bool = True) -> _HostWork:
        """Start ``call(host_in, host_out)`` on gloo, ``host_in`` being ``inputs`` staged; wait writes
        ``outputs`` back.

        An output that is also an input starts from its staged data with ``in_place``, else it gets a
        host buffer of its own; pure outputs get fresh host buffers. ``call`` returns the gloo Work, or a
        list of them.
        """
        staged = {id(t): host for t, host in zip(inputs, host_in)}

        def output_buffer(tensor):
            if id(tensor) not in staged:
                return _host_buffer(tensor)
            if not in_place:
                return host_buffers.empty(tensor.shape, tensor.dtype)
            return _writable(staged[id(tensor)]) if _is_xla(tensor) else staged[id(tensor)]

        host_out = [output_buffer(t) for t in outputs]
        return _HostWork(call(host_in, host_out), outputs, host_out)

    def _run(self, inputs, outputs, call, in_place: bool = True) -> dist.Work:
        """Issue a collective; it runs when waited on (``_Issued``). ``in_place``: see ``_launch``.

        A one-rank group copies on the device instead: staging would cut the step's graph for nothing.
        """
        if self.size() == 1:
            _ISSUED.before_now(inputs, outputs)
            _copy_local(inputs, outputs)
            return _done(list(outputs))
        work = _PendingWork(self, inputs, outputs, call, in_place)
        _ISSUED.add(work)
        return work

    # coalescing: torch runs the recorded ops through the *_coalesced methods below
    def _start_coalescing(self, device: torch.device) -> None:
        """Nothing to start; the C++ default looks for a per-device backend, which a Python group lacks."""

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        """torch keeps this Work, not the coalesced op's, when a device is given: run the op now."""
        _ISSUED.run()
        return _done()

    # all-reduce family
    def allreduce(self, tensors, opts):
        return self._allreduce(tensors, opts.reduceOp, lambda out: self._gloo.allreduce(out, opts))

    def allreduce_coalesced(self, tensors, opts):
        """One all-reduce per tensor (gloo's coalesced one needs a single dtype), staged together."""
        all_opts = dist.AllreduceOptions()
        all_opts.reduceOp = opts.reduceOp
        return self._allreduce(tensors, opts.reduceOp, lambda out: [self._gloo.allreduce([t], all_opts) for t in out])

    def _allreduce(self, tensors, op, on_gloo: Callable) -> dist.Work:
        """Between two ranks where staging is zero-copy, swap operands (``_pairwise``); else ``on_gloo(host
        buffers)``. The choice never depends on a rank's tensors, so both ranks of a pair make the same."""
        combine = _PAIRWISE.get(op.op)
        if self.size() == 2 and combine is not None and _zero_copy():
            return self._run(tensors, tensors, functools.partial(self._pairwise, combine), in_place=False)
        return self._run(tensors, tensors, lambda _, out: on_gloo(out))

    def _pairwise(self, combine: Callable, host_in, host_out) -> dist.Work:
        """All-reduce of two ranks: swap operands whole, then combine the peer's with our own.

        gloo reduces in place, and a zero-copy operand is read-only: the in-place path copies each
        operand first (12 of 75 ms for 64 MB on 2 cores). The swap moves as many bytes as gloo's ring
        on two ranks, and both ranks compute ``combine`` of the same two values, so they agree.
        """
        peer = 1 - self.rank()
        works = [work for mine, theirs in zip(host_in, host_out) for work in
                 (self._gloo.send([mine], peer, _PAIRWISE_TAG), self._gloo.recv([theirs], peer, _PAIRWISE_TAG))]
        _wait(works)
        for mine, theirs in zip(host_in, host_out):
            combine(theirs, mine, out=theirs)
        return _done()

    def reduce(self, tensors, opts):
        """Only the root's tensors change: gloo scribbles on the others' buffers, which stay on the host."""
        outputs = tensors if self.rank() == opts.rootRank else []
        return self._run(tensors, outputs, lambda i, o: self._gloo.reduce(o or [_writable(t) for t in i], opts))

    def broadcast(self, tensors, opts):
        inputs = tensors if self.rank() == opts.rootRank else []
        return self._run(inputs, tensors, lambda _, out: self._gloo.broadcast(out, opts))

    # gather family
    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or AllgatherOptions()
        flat = _flatten(output_lists)
        return self._run(inputs, flat,
                         lambda i, o: self._gloo.allgather(_unflatten(o, output_lists), i, opts))

    def _allgather_base(self, output, input, opts=None):
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or AllgatherOptions()
        return self._run(inputs, outputs, lambda i, o: [
            self._gloo._allgather_base(out, inp, opts) for out, inp in zip(_as_1d(o), _as_1d(i))])

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        opts = opts or AllgatherOptions()
        flat = _flatten(output_lists)
        return self._run(inputs, flat,
                         lambda i, o: self._gloo.allgather_coalesced(_unflatten(o, output_lists), i, opts))

    def gather(self, output_lists, inputs, opts):
        flat = _flatten(output_lists)
        return self._run(inputs, flat, lambda i, o: self._gloo.gather(_unflatten(o, output_lists), i, opts))

    # scatter family
    def reduce_scatter(self, outputs, input_lists, opts):
        flat = _flatten(input_lists)
        return self._run(flat, outputs,
                         lambda i, o: self._gloo.reduce_scatter(o, _unflatten(i, input_lists), opts))

    def _reduce_scatter_base(self, output, input, opts):
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run(inputs, outputs, lambda i, o: [
            self._gloo._reduce_scatter_base(out, inp, opts) for out, inp in zip(_as_1d(o), _as_1d(i))])

    def scatter(self, outputs, input_lists, opts):
        flat = _flatten(input_lists)
        return self._run(flat, outputs, lambda i, o: self._gloo.scatter(o, _unflatten(i, input_lists), opts))

    # all-to-all
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        return self._run([input], [output], lambda i, o: self._gloo.alltoall_base(
            o[0], i[0], output_split_sizes, input_split_sizes, opts))

    def alltoall(self, outputs, inputs, opts):
        return self._run(inputs, outputs, lambda i, o: self._alltoall_host(o, i, opts))

    def _alltoall_host(self, outputs, inputs, opts):
        """gloo has no list all-to-all: one alltoall_base between flat buffers split by numel."""
        out_sizes = [t.numel() for t in outputs]
        flat_out = host_buffers.empty((sum(out_sizes),), outputs[0].dtype)
        _wait(self._gloo.alltoall_base(flat_out, torch.cat(_as_1d(inputs)), out_sizes, [t.numel() for t in inputs],
                                       opts))
        for output, chunk in zip(outputs, flat_out.split(out_sizes)):
            output.copy_(chunk.view_as(output))
        return _done()

    # point to point: left running, or two ranks that both isend before they irecv would deadlock
    def send(self, tensors, dst, tag=0):
        return self._start(tensors, [], lambda i, _: self._gloo.send(i, dst, tag))

    def recv(self, tensors, src, tag=0):
        return self._start([], tensors, lambda _, o: self._gloo.recv(o, src, tag))

    def recv_anysource(self, tensors, tag=0):
        return self._start([], tensors, lambda _, o: self._gloo.recv_anysource(o, tag))

    def barrier(self, opts=None):
        _ISSUED.run()
        _wait(self._gloo.barrier(opts or dist.BarrierOptions()))
        return _done()

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self.barrier()


@watchdog.watched
def _create(store, rank, size, timeout):
    return HostStagedProcessGroup(store, rank, size, timeout)


def register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "xla"])


register()
