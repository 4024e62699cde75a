"""``xla_ds``: torch_xla's ``xla`` process group with the gaps DeepSpeed runs into filled.

Used where XLA itself connects the processes (TPU). Upstream ``ProcessGroupXla`` (torch_xla 2.9):
- ``barrier`` does nothing, but DeepSpeed orders checkpoint I/O with barriers;
- CPU tensors are rejected, but torch.distributed's object collectives (checkpoint tags,
  ``broadcast_object_list``) use CPU tensors for this group;
- ``reduce``, ``gather``, ``scatter`` and the list ``alltoall`` are blind to the group: they reduce or
  exchange over the whole world and compare the global ordinal with the group's root (ZeRO-2 reduces each
  gradient slice to its owner in its data-parallel group), and ``reduce`` and ``gather`` cut the graph after
  every tensor so that the non-roots, which drop the result, still run the collective;
- ``allreduce_coalesced`` raises, the coalescing manager's ``allgather_into_tensor_coalesced`` (ZeRO-1/2's
  parameter all-gather) and ``reduce_scatter_tensor_coalesced`` are missing, ``AVG`` is refused,
  ``allgather_coalesced`` fills torch's layout transposed, and ``alltoall_base`` ignores split sizes and
  the group;
- ``send``/``recv`` compile a pairwise ``collective_permute`` that only the two peers run, and a
  subgroup's collectives use the group alone as XLA replica groups; XLA on TPU needs replica groups
  that tile the whole world (pytorch/xla#8271).
This subclass fixes those and leaves the rest (``allgather``, ``_allgather_base``) to torch_xla. A
collective issues one XLA collective and cuts no graph: a root is told apart by a device boolean, so every
member compiles the same graph, and a result a member drops is held until its graph has run (``_keep``).
Point-to-point transfers (DeepSpeed's pipeline activations and gradients) and subgroups that cannot tile
the world go through host memory over gloo (``host_staged``); subgroups that do tile it — DeepSpeed's data,
pipe, model and expert groups — run XLA collectives with the full tiling as replica groups.
``tests/comm/test_xla_collectives_devices.py`` runs every op across 2 and 4 XLA devices.
"""
import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from deepspeed_xla import xla_runtime
from deepspeed_xla.comm import accounting, watchdog
from deepspeed_xla.comm.host_staged import HostStagedProcessGroup
from deepspeed_xla.comm.work import completed_work as _done

BACKEND_NAME = "xla_ds"
_HOST_ROUTED = []  # non-empty inside ``host_routed``


@contextlib.contextmanager
def host_routed() -> Iterator[None]:
    """Every ``xla_ds`` group's collectives go through host memory (gloo) inside the block.

    For tracing a rank's TPU step graph on PJRT CPU processes, which XLA connects to no other device
    (``bench/rank_graphs.py``): they warm up over gloo, then trace a step whose collectives are XLA's, unexecuted.
    """
    _HOST_ROUTED.append(True)
    try:
        yield
    finally:
        _HOST_ROUTED.pop()


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
    """The world split into translates of ``ranks`` (how DeepSpeed's topology groups tile it), one of them
    ``ranks`` itself, or None.

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
    return mesh if ranks in mesh else None  # [1, 2] of 4: translates of it cannot start at rank 0


# Ops a subgroup that cannot tile the world runs through host memory instead of XLA.
_COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
                "allgather_into_tensor_coalesced", "broadcast", "reduce", "reduce_scatter", "_reduce_scatter_base",
                "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "gather", "scatter", "barrier")


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
            return None if _HOST_ROUTED else self.__dict__.get("_replica_groups", [])

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
            return xla_runtime.current_device()

        def _is_member(self, group_rank: int, like: torch.Tensor) -> torch.Tensor:
            """A device boolean, true on the member ``group_rank``: the members differ in data, not in their graph.

            Kept per root and device, so only a group's first call with a root uploads it."""
            masks = self.__dict__.setdefault("_member_masks", {})
            key = (group_rank, str(like.device))
            if key not in masks:
                masks[key] = torch.tensor(self.rank() == group_rank).to(like.device)
            return masks[key]

        def _keep(self, result: torch.Tensor) -> None:
            """Hold one element of a collective's result until the graph computing it has run.

            A member that drops the result (the non-roots of reduce and gather, a caller's temporary bucket) would
            leave the collective out of its graph, and the members that kept theirs would wait for it for ever;
            torch_xla's reduce and gather cut the graph after each tensor instead."""
            kept = self.__dict__.get("_kept", [])
            kept = [t for t, pending in zip(kept, xla_runtime.pending(kept)) if pending]
            if result.numel():
                kept.append(result.detach().reshape(-1)[:1])
            self.__dict__["_kept"] = kept

        def _reduction(self, op) -> Tuple[str, float]:
            """XLA's reduce type and scale for a torch ReduceOp (AVG: a sum scaled by 1/size)."""
            if op == dist.ReduceOp.AVG:
                return xla_runtime.xm().REDUCE_SUM, 1.0 / self.size()
            return self._get_reduce_type(op), 1.0

        def _via_device(self, tensors: List[torch.Tensor], op: Callable[[List[torch.Tensor]], object],
                        written: Optional[List[torch.Tensor]] = None):
            """Run ``op`` on device copies of CPU tensors and copy back those it writes (``written``; all of them by
            default: in place).

            Reading them back waits for the peers (the object collectives): the watchdog counts it as a wait, so
            that a peer that ended meanwhile is this rank's failure instead of a wait for ever."""
            if all(t.device.type == "xla" for t in tensors):
                return op(tensors)
            staged = [t if t.device.type == "xla" else t.to(self._device()) for t in tensors]
            op(staged)
            outputs = {id(t) for t in (tensors if written is None else written)}
            copies = [(original, result) for original, result in zip(tensors, staged)
                      if original is not result and id(original) in outputs]
            with watchdog.waiting():
                for original, result in copies:
                    original.copy_(result.cpu())
            return _done(tensors)

        def allreduce(self, tensors, opts):
            """One all-reduce of the tensors of each dtype, flattened into one: torch_xla's in-place list form
            threads its per-device token through every collective, and a replay of DeepSpeed's calls hung on it."""
            kind, scale = self._reduction(opts.reduceOp)

            def op(staged):
                by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
                for tensor in staged:
                    by_dtype.setdefault(tensor.dtype, []).append(tensor)
                for same in by_dtype.values():
                    flat = torch.cat([t.reshape(-1) for t in same]) if len(same) > 1 else same[0].reshape(-1)
                    result = xla_runtime.xm().all_reduce(kind, flat, scale=scale, groups=self._mesh, pin_layout=False)
                    with torch.no_grad():
                        for tensor, piece in zip(same, result.split([t.numel() for t in same])):
                            tensor.copy_(piece.reshape(tensor.shape))
                return _done(staged)

            return self._via_device(tensors, op)

        def allreduce_coalesced(self, tensors, opts):
            """One all-reduce of every tensor (``allreduce`` reads only the options' ``reduceOp``)."""
            return self.allreduce(tensors, opts)

        def broadcast(self, tensors, opts):
            """The root's data and zeros from every other member, summed over the group: torch_xla's version maps
            the root through torch's group registry, multiplies the others' data by 0 (NaN stays NaN) and uploads
            the root flag on every call."""

            def op(staged):
                target = staged[opts.rootTensor]
                source = torch.where(self._is_member(opts.rootRank, target), target, torch.zeros_like(target))
                kind = xla_runtime.xm().REDUCE_OR if target.dtype == torch.bool else xla_runtime.xm().REDUCE_SUM
                with torch.no_grad():
                    target.copy_(xla_runtime.xm().all_reduce(kind, source, groups=self._mesh, pin_layout=False))
                return _done(staged)

            return self._via_device(tensors, op)

        def reduce(self, tensors, opts):
            """An all-reduce over the group; the root takes the result, the others keep their tensor."""
            kind, scale = self._reduction(opts.reduceOp)

            def op(staged):
                for tensor in staged:
                    result = xla_runtime.xm().all_reduce(kind, tensor, scale=scale, groups=self._mesh,
                                                         pin_layout=False)
                    with torch.no_grad():
                        tensor.copy_(torch.where(self._is_member(opts.rootRank, tensor), result, tensor))
                    self._keep(result)
                return _done(staged)

            return self._via_device(tensors, op)

        def gather(self, output_tensors_list, input_tensors, opts):
            """An all-gather over the group; only the root copies it out (its output list is the only one)."""
            outputs = [t for outputs in output_tensors_list for t in outputs]

            def op(staged):
                staged_inputs, it = staged[:len(input_tensors)], iter(staged[len(input_tensors):])
                for index, tensor in enumerate(staged_inputs):
                    gathered = xla_runtime.xm().all_gather(tensor.reshape(1, -1), 0, groups=self._mesh,
                                                           pin_layout=False)
                    self._keep(gathered)
                    targets = output_tensors_list[index] if output_tensors_list else []
                    with torch.no_grad():
                        for row, _ in zip(gathered, targets):
                            target = next(it)
                            target.copy_(row.reshape(target.shape))
                return _done(staged)

            return self._via_device(list(input_tensors) + outputs, op, written=outputs)

        def scatter(self, output_tensors, input_tensors_list, opts):
            """A sum-reduce-scatter of the root's pieces and zeros from every other member."""
            inputs = [t for pieces in input_tensors_list for t in pieces]
            kind = xla_runtime.xm().REDUCE_SUM

            def op(staged):
                staged_outputs, it = staged[:len(output_tensors)], iter(staged[len(output_tensors):])
                for target, pieces in zip(staged_outputs, input_tensors_list or [[]] * len(output_tensors)):
                    pieces = [next(it).reshape(-1) for _ in pieces]
                    source = torch.cat(pieces) if pieces else target.new_zeros(self.size() * target.numel())
                    chunk = xla_runtime.xm().reduce_scatter(kind, source, 1.0, 0, self.size(), groups=self._mesh,
                                                            pin_layout=False)
                    with torch.no_grad():
                        target.copy_(chunk.reshape(target.shape))
                return _done(staged)

            return self._via_device(list(output_tensors) + inputs, op, written=list(output_tensors))

        def _reduce_scatter_base(self, output, input, opts):
            """``input`` holds the members' pieces one after another (concatenated or stacked on dim 0)."""
            kind, scale = self._reduction(opts.reduceOp)
            chunk = xla_runtime.xm().reduce_scatter(kind, input.reshape(-1), scale, 0, self.size(),
                                                    groups=self._mesh, pin_layout=False)
            with torch.no_grad():
                output.copy_(chunk.reshape(output.shape))
            return _done([output])

        def reduce_scatter(self, output_tensors, input_tensors_list, opts):
            for output, pieces in zip(output_tensors, input_tensors_list):
                self._reduce_scatter_base(output, torch.cat([t.reshape(-1) for t in pieces]), opts)
            return _done(output_tensors)

        def allgather(self, output_lists, inputs, opts=None):
            flat = [t for outputs in output_lists for t in outputs]

            def op(staged):
                staged_inputs, staged_outputs = staged[:len(inputs)], staged[len(inputs):]
                it = iter(staged_outputs)
                nested = [[next(it) for _ in outputs] for outputs in output_lists]
                return super(DeepSpeedXlaProcessGroup, self).allgather(nested, staged_inputs, opts)

            return self._via_device(list(inputs) + flat, op, written=flat)

        def allgather_coalesced(self, output_lists, inputs, opts=None):
            """One all-gather of every input; ``output_lists[member]`` takes each input of that member (torch's
            layout: torch_xla's version fills it transposed)."""
            gathered = xla_runtime.xm().all_gather([t.reshape(-1) for t in inputs], 0, groups=self._mesh,
                                                   pin_layout=False)
            with torch.no_grad():
                for index, (tensor, result) in enumerate(zip(inputs, gathered)):
                    for outputs, piece in zip(output_lists, result.split(tensor.numel())):
                        outputs[index].copy_(piece.reshape(outputs[index].shape))
            return _done([t for outputs in output_lists for t in outputs])

        def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
            """torch's coalescing manager around ``all_gather_into_tensor`` (ZeRO-1/2's gathering of the updated
            partitions): one all-gather of every input."""
            gathered = xla_runtime.xm().all_gather([t.reshape(-1) for t in inputs], 0, groups=self._mesh,
                                                   pin_layout=False)
            with torch.no_grad():
                for output, result in zip(outputs, gathered):
                    output.copy_(result.reshape(output.shape))
            return _done(outputs)

        def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
            """torch's coalescing manager around ``reduce_scatter_tensor``: one reduce-scatter of every input."""
            kind, scale = self._reduction(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
            chunks = xla_runtime.xm().reduce_scatter(kind, [t.reshape(-1) for t in inputs], scale, 0, self.size(),
                                                     groups=self._mesh, pin_layout=False)
            with torch.no_grad():
                for output, chunk in zip(outputs, chunks):
                    output.copy_(chunk.reshape(output.shape))
            return _done(outputs)

        def barrier(self, opts=None):
            """A real barrier: every member contributes to a reduction whose value this process reads."""
            token = torch.zeros(1, device=self._device())
            xla_runtime.xm().all_reduce(xla_runtime.xm().REDUCE_SUM, [token], groups=self._mesh, pin_layout=False)
            with watchdog.waiting():
                token.cpu()
            return _done([])

        def alltoall(self, output_tensors, input_tensors, opts):
            """torch's list form as one exchange of the flattened pieces (torch_xla's used the whole world)."""
            in_splits = [t.numel() for t in input_tensors]
            out_splits = [t.numel() for t in output_tensors]
            even = len(set(in_splits + out_splits)) == 1
            received = input_tensors[0].new_empty(sum(out_splits))
            self.alltoall_base(received, torch.cat([t.reshape(-1) for t in input_tensors]),
                               [] if even else out_splits, [] if even else in_splits, opts)
            with torch.no_grad():
                for target, piece in zip(output_tensors, received.split(out_splits)):
                    target.copy_(piece.reshape(target.shape))
            return _done(output_tensors)

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
            with watchdog.waiting():
                width = int(width.cpu())
            stacked = pad_chunks(input, in_splits, width)
            exchanged = xm.all_to_all(stacked.reshape(size * width, *input.shape[1:]), 0, 0, size,
                                      groups=self._mesh, pin_layout=False)
            output.copy_(unpad_chunks(exchanged.reshape(size, width, *input.shape[1:]), out_splits))
            return _done([output])

    for name in _COLLECTIVES:
        setattr(DeepSpeedXlaProcessGroup, name, _xla_or_host(name, getattr(DeepSpeedXlaProcessGroup, name)))
    return accounting.instrument(DeepSpeedXlaProcessGroup)


@watchdog.watched
def _create(store, rank, size, timeout):
    return make_process_group_class()(store, rank, size, timeout)


def register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["xla"])
