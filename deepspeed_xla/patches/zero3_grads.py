"""Patches of ZeRO-3's flat gradient buffer (``grad_partitions_flat_buffer``): how the reduce-scattered gradient
partitions get into it, and how the optimizer reads it.

Upstream writes and reads the buffer one parameter view at a time, which torch_xla lowers as a select (or a replayed
slice) over the whole buffer per parameter: host work and element operations per parameter, every step. These
wrappers write it once per backward and read a sub-group's span at once, with the same values.
"""
import functools

from deepspeed_xla.patches.zero import to_host_at_once


def stage3_partition_grads(original):
    """ZeRO-3: a bucket's gradient partitions reach the flat gradient buffer in one update per backward.

    Upstream copies each partition into its slice of ``grad_partitions_flat_buffer``. torch_xla lowers every copy
    into a slice as a select over the whole buffer (pytorch/xla#4791), so a step did (parameters x buffer) element
    operations, like ``contiguous_gradients`` in ZeRO-1/2; one update per bucket would still move (buckets x buffer)
    elements. Here the partitions are kept until the backward's epilogue (``stage3_writes_grads_at_epilogue``), which
    concatenates them with the untouched spans and copies the buffer once; the per-parameter views DeepSpeed reads
    after it see the same values. With ``contiguous_gradients`` the partitions are views of the bucket's buffer, which
    the next bucket overwrites: each bucket is written at once. Offloaded gradients live in host memory: a bucket's
    go there in one transfer, summed on the device with what earlier micro-steps accumulated
    (``_offloaded_partitions_to_host``). Relies on the buffer's layout, which ``__init__`` builds in ``fp16_groups``
    order (``_flat_offsets``).
    """

    @functools.wraps(original)
    def partition_grads(self, params_to_release, grad_partitions):
        flat = self.grad_partitions_flat_buffer
        if self.offload_optimizer and any(grad.device.type == "xla" for grad in grad_partitions):
            return _offloaded_partitions_to_host(self, params_to_release, grad_partitions)
        if self.offload_optimizer or flat.device.type != "xla":
            return original(self, params_to_release, grad_partitions)
        offsets, padding_only = _flat_offsets(self), _padding_only(self)
        views = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        _, spans = self.__dict__.setdefault(_PENDING_GRADS, (self.micro_step_id != 0, []))
        buffers = []
        for param, grad_partition in zip(params_to_release, grad_partitions):
            param.grad = None
            if param.ds_id in padding_only:
                continue
            self._offload_boundary_param_ids.add(param.ds_id)
            numel, offset, view = grad_partition.numel(), offsets[param.ds_id], views[param.ds_id]
            grad = grad_partition.to(flat.dtype)
            spans.append((offset, numel, grad if grad.dim() == 1 else grad.reshape(-1)))
            buffers.append(view if view.numel() == numel else view.narrow(0, 0, numel))
        if self.contiguous_gradients:
            _write_pending_grads(self)
        return buffers

    return partition_grads


_PENDING_GRADS = "_deepspeed_xla_pending_grads"
_PADDING_ONLY = "_deepspeed_xla_padding_only"


def _write_pending_grads(optimizer) -> None:
    """The kept gradient partitions into ZeRO-3's flat buffer: one concatenation, one copy; a later micro-step's are
    added to what the buffer holds, one add per run of adjacent partitions."""
    accumulate, spans = optimizer.__dict__.pop(_PENDING_GRADS, (False, []))
    if not spans:
        return
    import torch
    flat = optimizer.grad_partitions_flat_buffer
    pieces, end = [], 0  # tracing is the cost here (each op is host work): gaps of zero length add no piece
    for offset, numel, grads in _runs(spans):
        if offset > end:
            pieces.append(flat.narrow(0, end, offset - end))
        if accumulate:
            pieces.append(flat.narrow(0, offset, numel) + (torch.cat(grads) if len(grads) > 1 else grads[0]))
        else:
            pieces.extend(grads)
        end = offset + numel
    if end < flat.numel():
        pieces.append(flat.narrow(0, end, flat.numel() - end))
    flat.copy_(torch.cat(pieces) if len(pieces) > 1 else pieces[0])


def _runs(spans) -> list:
    """``(offset, numel, grads)`` of each run of adjacent ``(offset, numel, grad)`` spans, in the buffer's order."""
    runs = []
    for offset, numel, grad in sorted(spans, key=lambda span: span[0]):
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1][1] += numel
            runs[-1][2].append(grad)
        else:
            runs.append([offset, numel, [grad]])
    return runs


def _padding_only(optimizer) -> frozenset:
    """``ds_id`` of the parameters whose partition on this rank is padding only (upstream's ``contains_real_data``
    false), which the partitioning fixes: asked once, not per parameter and backward."""
    ids = optimizer.__dict__.get(_PADDING_ONLY)
    if ids is None:
        ids = optimizer.__dict__[_PADDING_ONLY] = frozenset(
            param.ds_id for group in optimizer.fp16_groups for param in group
            if param.partition_numel() * optimizer._get_param_partition_rank(param) >= param.ds_numel)
    return ids


def stage3_writes_grads_at_epilogue(original):
    """ZeRO-3's ``independent_gradient_partition_epilogue``, after which DeepSpeed reads the gradient partitions (the
    norm, the optimizer's input, ``safe_get_full_grad``): the partitions ``stage3_partition_grads`` kept go into the
    flat buffer here, once per backward (per phase with reentrant checkpointing, which runs it per phase)."""

    @functools.wraps(original)
    def independent_gradient_partition_epilogue(self):
        original(self)
        _write_pending_grads(self)

    return independent_gradient_partition_epilogue


def _offloaded_partitions_to_host(optimizer, params_to_release, grad_partitions) -> list:
    """ZeRO-3 offload's ``partition_grads``, its gradient partitions moved to the host flat buffer in one transfer;
    after the first micro-step of an accumulation each is first added, on the device, to the sum the buffer holds
    (an upload). Upstream copies each partition to the host, back to the device and to the host again (into the
    optimizer's fp32 partition): a graph and two transfers per parameter. Here DeepSpeed's boundary work (the norm,
    the fp32 copy or the NVMe swap) reads the host copy."""
    views = optimizer._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
    kept, padding_only = [], _padding_only(optimizer)
    for param, grad_partition in zip(params_to_release, grad_partitions):
        param.grad = None
        if param.ds_id not in padding_only:
            kept.append((param, grad_partition))
    if not kept:
        return []
    dtype = optimizer.grad_partitions_flat_buffer.dtype
    held = [views[param.ds_id].narrow(0, 0, grad.numel()) for param, grad in kept]
    sums = [grad for _, grad in kept]
    if optimizer.micro_step_id != 0:
        sums = [buffer.to(grad.device) + grad.to(optimizer.gradient_accumulation_dtype).view(buffer.shape)
                for buffer, grad in zip(held, sums)]
    boundary = optimizer.is_gradient_accumulation_boundary()
    offload_fp32_gradients, offload_fp32_offsets = {}, {}
    for (param, _), buffer, values in zip(kept, held, to_host_at_once(sums, dtype)):
        optimizer._offload_boundary_param_ids.add(param.ds_id)
        buffer.copy_(values)
        if boundary:
            optimizer._offload_grad_partition_at_boundary(param, buffer, offload_fp32_gradients,
                                                          offload_fp32_offsets)
    optimizer._swap_out_offload_fp32_gradients(offload_fp32_gradients, offload_fp32_offsets)
    return held


def _flat_offsets(optimizer) -> dict:
    """Each parameter's offset in ZeRO-3's flat gradient buffer (laid out in ``fp16_groups`` order)."""
    offsets = getattr(optimizer, "_xla_grad_offsets", None)
    if offsets is None:
        offsets, offset = {}, 0
        for group in optimizer.fp16_groups:
            for param in group:
                offsets[param.ds_id] = offset
                offset += param.partition_numel()
        optimizer._xla_grad_offsets = offsets
    return offsets


def stage3_fp32_grad_from_flat_buffer(original):
    """ZeRO-3: hand the optimizer one copy of the sub-group's span of the flat gradient buffer.

    Upstream concatenates the sub-group's gradient partitions, which are consecutive views of
    ``grad_partitions_flat_buffer`` (``independent_gradient_partition_epilogue``): on XLA each view
    read after the buffer's update replays its slice, and the concatenation rebuilds the same span
    (host work per parameter, every step). Other gradient lists (frozen parameters' zeros,
    offload) take the upstream path.
    """

    @functools.wraps(original)
    def prepare_fp32_grad(self, sub_group_id):
        span = _grad_buffer_span(self, sub_group_id)
        fp32 = self.fp32_partitioned_groups_flat[sub_group_id]
        if span is None or span.numel() != fp32.numel():
            return original(self, sub_group_id)
        fp32.grad = span.to(fp32.dtype, copy=True)
        self.averaged_gradients[sub_group_id] = None

    return prepare_fp32_grad


def _grad_buffer_span(optimizer, sub_group_id):
    """The span of ZeRO-3's flat gradient buffer whose views are the sub-group's averaged gradients, or None."""
    flat, grads = optimizer.grad_partitions_flat_buffer, optimizer.averaged_gradients[sub_group_id]
    params = optimizer.fp16_groups[sub_group_id]
    if optimizer.offload_optimizer or flat.device.type != "xla" or not params or len(grads) != len(params):
        return None
    views = optimizer._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
    if any(grad is not views[param.ds_id] for grad, param in zip(grads, params)):
        return None
    return flat.narrow(0, _flat_offsets(optimizer)[params[0].ds_id], sum(grad.numel() for grad in grads))
