"""``xla_ds``: torch_xla's ``xla`` process group with the gaps DeepSpeed runs into filled.

Used where XLA itself connects the processes (TPU). Upstream ``ProcessGroupXla`` (torch_xla 2.9):
- ``barrier`` does nothing, but DeepSpeed orders checkpoint I/O with barriers;
- CPU tensors are rejected, but torch.distributed's object collectives (checkpoint tags,
  ``broadcast_object_list``) use CPU tensors for this group;
- ``allreduce_coalesced`` raises, and ``alltoall_base`` ignores split sizes and the group.
- ``send``/``recv`` compile a pairwise ``collective_permute`` that only the two peers run, and a
  subgroup's collectives use the group alone as XLA replica groups; XLA on TPU needs replica groups
  that tile the whole world (pytorch/xla#8271).
This subclass fixes exactly those and leaves every other op to torch_xla. Point-to-point transfers
(DeepSpeed's pipeline activations and gradients) and subgroups that cannot tile the world go through
host memory over gloo (``host_staged``); subgroups that do tile it — DeepSpeed's data, pipe and model
groups — run XLA collectives with the full tiling as replica groups.
"""
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from deepspeed_xla import xla_runtime
from deepspeed_xla.comm import watchdog
from deepspeed_xla.comm.host_staged import HostStagedProcessGroup
from deepspeed_xla.comm.work import completed_work as _done

BACKEND_NAME = "xla_ds"


def pad_chunks(tensor: torch.Tensor, splits: Sequence[int], width: int) -> torch.Tensor:
    """Split dim 0 by ``splits`` and zero-pad each piece to ``width`` rows: ``[len(splits), width, ...]``."""
    rows = []
    for piece in tensor.split(list(splits)):
        pad = torch.zeros((width - piece.shape[0], *piece.shape[1:]), dtype=piece.dtype, device=piece.device)
        rows.append(torch.cat([piece, pad]))
    return torch.stack(rows)


def unpad_chunks(stacked: torch.Tensor, splits: Sequence[int]) -> torch.Tensor:
    return torch.cat([stacked[i, :n] for i, n in enumerate(splits)])


def tiling_mesh(ranks: Sequence[int], world_size: int) -> Optional[List[List[int]]]:
    """The world split into translates of ``ranks`` (how DeepSpeed's topology groups tile it), or None.

    XLA replica groups must cover every device once; torch_xla infers them only for 2-d layouts.
    """
    ranks = sorted(ranks)
    offsets = [r - ranks[0] for r in ranks]
    mesh, covered = [], set()
    for start in range(world_size):
        if start in covered:
            continue
        group = [start + offset for offset in offsets]
        if any(r >= world_size or r in covered for r in group):
            return None
        covered.update(group)
        mesh.append(group)
    return mesh


# Ops a subgroup that cannot tile the world runs through host memory instead of XLA.
_COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
                "broadcast", "reduce", "reduce_scatter", "_reduce_scatter_base", "alltoall", "alltoall_base",
                "gather", "scatter", "barrier")


def _xla_or_host(name: str, xla_op: Callable) -> Callable:
    def op(self, *args, **kwargs):
        if self._mesh is None:
            return getattr(self._host, name)(*args, **kwargs)
        return xla_op(self, *args, **kwargs)

    op.__name__ = name
    return op


def make_process_group_class():
    """Built on first use: importing torch_xla's backend module is only allowed in worker processes."""
    base = xla_runtime.xla_process_group_class()

    class DeepSpeedXlaProcessGroup(base):

        def __init__(self, store, rank: int, size: int, timeout):
            super().__init__(store, rank, size, timeout)
            # Only pairs that exchange data connect: pipeline neighbours, members of host-only groups.
            self._host = HostStagedProcessGroup(dist.PrefixStore("host/", store), rank, size, timeout,
                                                connect_on_first_use=True)

        def getBackendName(self) -> str:
            return BACKEND_NAME

        @property
        def _mesh(self) -> Optional[List[List[int]]]:
            """XLA replica groups; None routes this group's collectives through host memory."""
            return self.__dict__.get("_replica_groups", [])

        @_mesh.setter
        def _mesh(self, groups: List[List[int]]) -> None:
            """torch_xla's ``new_group`` sets ``[ranks]`` for a subgroup: widen it to a tiling of the world."""
            if len(groups) == 1 and len(groups[0]) < dist.get_world_size():
                groups = tiling_mesh(groups[0], dist.get_world_size())
            self.__dict__["_replica_groups"] = groups

        def send(self, tensors, dst, tag=0):
            return self._host.send(tensors, dst, tag)

        def recv(self, tensors, src, tag=0):
            return self._host.recv(tensors, src, tag)

        def recv_anysource(self, tensors, tag=0):
            return self._host.recv_anysource(tensors, tag)

        def _device(self):
            return xla_runtime.device()

        def _via_device(self, tensors: List[torch.Tensor], op: Callable[[List[torch.Tensor]], object]):
            """Run ``op`` on device copies of CPU tensors and copy the results back."""
            if all(t.device.type == "xla" for t in tensors):
                return op(tensors)
            staged = [t if t.device.type == "xla" else t.to(self._device()) for t in tensors]
            op(staged)
            for original, result in zip(tensors, staged):
                if original is not result:
                    original.copy_(result.cpu())
            return _done(tensors)

        def allreduce(self, tensors, opts):
            return self._via_device(tensors, lambda ts: super(DeepSpeedXlaProcessGroup, self).allreduce(ts, opts))

        def broadcast(self, tensors, opts):
            return self._via_device(tensors, lambda ts: super(DeepSpeedXlaProcessGroup, self).broadcast(ts, opts))

        def allgather(self, output_lists, inputs, opts=None):
            flat = [t for outputs in output_lists for t in outputs]

            def op(staged):
                staged_inputs, staged_outputs = staged[:len(inputs)], staged[len(inputs):]
                it = iter(staged_outputs)
                nested = [[next(it) for _ in outputs] for outputs in output_lists]
                return super(DeepSpeedXlaProcessGroup, self).allgather(nested, staged_inputs, opts)

            return self._via_device(list(inputs) + flat, op)

        def allreduce_coalesced(self, tensors, opts):
            all_opts = dist.AllreduceOptions()
            all_opts.reduceOp = opts.reduceOp
            for tensor in tensors:
                self.allreduce([tensor], all_opts)
            return _done(tensors)

        def barrier(self, opts=None):
            """A real barrier: every member contributes to a reduction whose value this process reads."""
            token = torch.zeros(1, device=self._device())
            xla_runtime.xm().all_reduce(xla_runtime.xm().REDUCE_SUM, [token], groups=self._mesh, pin_layout=False)
            with watchdog.waiting():
                token.cpu()
            return _done([])

        def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
            """All-to-all with uneven splits: pad to the largest split any member sends, exchange, unpad. Without
            split sizes (torch's even split: MoE's and Ulysses' all-to-alls) the exchange stays in the graph, with
            no width to agree on through a host read."""
            size = self.size()
            xm = xla_runtime.xm()
            if not input_split_sizes and not output_split_sizes:
                output.copy_(xm.all_to_all(input, 0, 0, size, groups=self._mesh, pin_layout=False))
                return _done([output])
            in_splits = list(input_split_sizes) or [input.shape[0] // size] * size
            out_splits = list(output_split_sizes) or [output.shape[0] // size] * size
            width = torch.tensor([max(in_splits + out_splits)], device=self._device())
            xm.all_reduce(xm.REDUCE_MAX, [width], groups=self._mesh, pin_layout=False)
            width = int(width.cpu())
            stacked = pad_chunks(input, in_splits, width)
            exchanged = xm.all_to_all(stacked.reshape(size * width, *input.shape[1:]), 0, 0, size,
                                      groups=self._mesh, pin_layout=False)
            output.copy_(unpad_chunks(exchanged.reshape(size, width, *input.shape[1:]), out_splits))
            return _done([output])

    for name in _COLLECTIVES:
        setattr(DeepSpeedXlaProcessGroup, name, _xla_or_host(name, getattr(DeepSpeedXlaProcessGroup, name)))
    return DeepSpeedXlaProcessGroup


@watchdog.watched
def _create(store, rank, size, timeout):
    return make_process_group_class()(store, rank, size, timeout)


def register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["xla"])
