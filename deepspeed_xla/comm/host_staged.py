"""``xla_host``: a torch.distributed backend that runs collectives on XLA tensors through host memory.

PJRT CPU has no cross-process XLA collectives, and gloo handed XLA tensors silently does nothing or
hangs. This process group materializes the XLA operands (one execution for all of them), runs the
op with gloo on host copies, and writes the results back into the XLA tensors; CPU tensors go to
gloo directly. Everything above torch.distributed (DeepSpeed's comm layer, ZeRO, the pipeline
engine) runs the same code as on TPU, where the ``xla`` backend is used instead.

Subgroups work as usual: ``new_group`` calls the creator again with the group's own store.
Ops complete before they return; the returned Work is already finished.
"""
from datetime import timedelta
from typing import List, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

from deepspeed_xla import xla_runtime

BACKEND_NAME = "xla_host"


def _is_xla(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "xla"


def _to_host(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Host tensors for ``tensors``: CPU ones as they are, XLA ones copied with one execution."""
    xla = [t for t in tensors if _is_xla(t)]
    copies = iter(xla_runtime.to_host(xla) if xla else [])
    return [next(copies) if _is_xla(t) else t for t in tensors]


def _write_back(targets: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor]) -> None:
    for target, host in zip(targets, hosts):
        if target is not host:
            target.copy_(host.to(target.device) if _is_xla(target) else host)


def _done(result=None) -> dist.Work:
    future = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)


def _flatten(lists: Sequence[Sequence[torch.Tensor]]) -> List[torch.Tensor]:
    return [t for inner in lists for t in inner]


def _unflatten(flat: Sequence[torch.Tensor], like: Sequence[Sequence[torch.Tensor]]) -> List[List[torch.Tensor]]:
    it = iter(flat)
    return [[next(it) for _ in inner] for inner in like]


class HostStagedProcessGroup(ProcessGroup):
    """Collectives for XLA tensors over gloo, staged through host memory."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self):
        return self._group_name

    def _run(self, inputs, outputs, call):
        """Stage ``inputs`` and ``outputs`` to host, run ``call(host_in, host_out)`` on gloo, write back."""
        hosts = _to_host(list(inputs) + list(outputs))
        host_in, host_out = hosts[:len(inputs)], hosts[len(inputs):]
        call(host_in, host_out).wait()
        _write_back(outputs, host_out)
        return _done(list(outputs))

    # all-reduce family
    def allreduce(self, tensors, opts):
        if opts.reduceOp == dist.ReduceOp.AVG:
            sum_opts = dist.AllreduceOptions()
            sum_opts.reduceOp = dist.ReduceOp.SUM
            work = self.allreduce(tensors, sum_opts)
            for tensor in tensors:
                tensor.div_(self.size())
            return work
        return self._run([], tensors, lambda _, out: self._gloo.allreduce(out, opts))

    def allreduce_coalesced(self, tensors, opts):
        all_opts = dist.AllreduceOptions()
        all_opts.reduceOp = opts.reduceOp
        for tensor in tensors:
            self.allreduce([tensor], all_opts)
        return _done(tensors)

    def reduce(self, tensors, opts):
        return self._run([], tensors, lambda _, out: self._gloo.reduce(out, opts))

    def broadcast(self, tensors, opts):
        return self._run([], tensors, lambda _, out: self._gloo.broadcast(out, opts))

    # gather family
    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        flat = _flatten(output_lists)
        return self._run(inputs, flat,
                         lambda i, o: self._gloo.allgather(_unflatten(o, output_lists), i, opts))

    def _allgather_base(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._run([input], [output], lambda i, o: self._gloo._allgather_base(o[0], i[0], opts))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):
            self._allgather_base(output, input, opts)
        return _done(outputs)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        for outputs, input in zip(output_lists, inputs):
            self.allgather([outputs], [input], opts)
        return _done(output_lists)

    def gather(self, output_lists, inputs, opts):
        flat = _flatten(output_lists)
        return self._run(inputs, flat, lambda i, o: self._gloo.gather(_unflatten(o, output_lists), i, opts))

    # scatter family
    def reduce_scatter(self, outputs, input_lists, opts):
        flat = _flatten(input_lists)
        return self._run(flat, outputs,
                         lambda i, o: self._reduce_scatter_host(o, _unflatten(i, input_lists), opts))

    def _reduce_scatter_host(self, outputs, input_lists, opts):
        """gloo has no list reduce-scatter: all-reduce each rank's chunk stack, keep our own chunk."""
        for output, chunks in zip(outputs, input_lists):
            stacked = torch.stack([c.reshape(-1) for c in chunks])
            all_opts = dist.AllreduceOptions()
            all_opts.reduceOp = opts.reduceOp
            self._gloo.allreduce([stacked], all_opts).wait()
            output.copy_(stacked[self.rank()].view_as(output))
        return _done()

    def _reduce_scatter_base(self, output, input, opts):
        chunks = list(input.chunk(self.size()))
        return self.reduce_scatter([output], [chunks], opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):
            self._reduce_scatter_base(output, input, opts)
        return _done(outputs)

    def scatter(self, outputs, input_lists, opts):
        flat = _flatten(input_lists)
        return self._run(flat, outputs, lambda i, o: self._gloo.scatter(o, _unflatten(i, input_lists), opts))

    # all-to-all
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        return self._run([input], [output], lambda i, o: self._gloo.alltoall_base(
            o[0], i[0], output_split_sizes, input_split_sizes, opts))

    def alltoall(self, outputs, inputs, opts):
        return self._run(inputs, outputs, lambda i, o: self._gloo.alltoall(o, i, opts))

    # point to point
    def send(self, tensors, dst, tag=0):
        return self._run(tensors, [], lambda i, _: self._gloo.send(i, dst, tag))

    def recv(self, tensors, src, tag=0):
        return self._run([], tensors, lambda _, o: self._gloo.recv(o, src, tag))

    def recv_anysource(self, tensors, tag=0):
        return self._run([], tensors, lambda _, o: self._gloo.recv_anysource(o, tag))

    def barrier(self, opts=None):
        self._gloo.barrier(opts or dist.BarrierOptions()).wait()
        return _done()

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self.barrier()


def _create(store, rank, size, timeout):
    return HostStagedProcessGroup(store, rank, size, timeout)


def register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "xla"])


register()
