"""Patches of DeepSpeed's ZeRO (``deepspeed.runtime.zero``): ZeRO-3's step and hooks, ZeRO-1/2's overflow,
offloaded gradients, and ``zero.Init``'s move of parameters made on the host.

Upstream writes and reads ZeRO's flat gradient buffer one parameter view at a time, which torch_xla
lowers as a select (or a replayed slice) over the whole buffer per parameter, and ZeRO-3's autograd
Functions pay torch's argument binding on every call: host work per parameter and per module, every
step. ZeRO-1/2 all-reduce and read an overflow flag the device-side step guard already covers. With the
optimizer offloaded, every stage moves gradients to the host one parameter at a time. These wrappers do the
same work once per buffer, or leave it to the device, with the same values.
"""
import functools
import inspect


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
        offsets = _flat_offsets(self)
        views = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        accumulate = self.micro_step_id != 0
        spans, buffers = self.__dict__.setdefault(_PENDING_GRADS, []), []
        for param, grad_partition in zip(params_to_release, grad_partitions):
            param.grad = None
            if param.partition_numel() * self._get_param_partition_rank(param) >= param.ds_numel:
                continue  # this rank's partition of the parameter is padding only
            self._offload_boundary_param_ids.add(param.ds_id)
            numel, offset, view = grad_partition.numel(), offsets[param.ds_id], views[param.ds_id]
            grad = grad_partition.to(flat.dtype)
            if grad.dim() != 1:
                grad = grad.reshape(-1)
            if accumulate:
                grad = flat.narrow(0, offset, numel) + grad
            spans.append((offset, numel, grad))
            buffers.append(view if view.numel() == numel else view.narrow(0, 0, numel))
        if self.contiguous_gradients:
            _write_pending_grads(self)
        return buffers

    return partition_grads


_PENDING_GRADS = "_deepspeed_xla_pending_grads"


def _write_pending_grads(optimizer) -> None:
    """The kept gradient partitions into ZeRO-3's flat buffer: one concatenation, one copy."""
    spans = optimizer.__dict__.pop(_PENDING_GRADS, None)
    if not spans:
        return
    import torch
    flat = optimizer.grad_partitions_flat_buffer
    pieces, end = [], 0  # tracing is the cost here (each op is host work): gaps of zero length add no piece
    for offset, numel, grad in sorted(spans, key=lambda span: span[0]):
        if offset > end:
            pieces.append(flat.narrow(0, end, offset - end))
        pieces.append(grad)
        end = offset + numel
    if end < flat.numel():
        pieces.append(flat.narrow(0, end, flat.numel() - end))
    flat.copy_(torch.cat(pieces))


def stage3_writes_grads_at_epilogue(original):
    """ZeRO-3's ``independent_gradient_partition_epilogue``, after which DeepSpeed reads the gradient partitions (the
    norm, the optimizer's input, ``safe_get_full_grad``): the partitions ``stage3_partition_grads`` kept go into the
    flat buffer here, once per backward (per phase with reentrant checkpointing, which runs it per phase)."""

    @functools.wraps(original)
    def independent_gradient_partition_epilogue(self):
        original(self)
        _write_pending_grads(self)

    return independent_gradient_partition_epilogue


def _to_host_at_once(tensors, dtype) -> list:
    """Host copies of XLA ``tensors``, flattened and as ``dtype``, from one graph execution and one transfer."""
    import torch
    from deepspeed_xla import xla_runtime
    flat = torch.cat([tensor.reshape(-1).to(dtype) for tensor in tensors])
    return list(xla_runtime.to_host([flat])[0].split([tensor.numel() for tensor in tensors]))


def _offloaded_partitions_to_host(optimizer, params_to_release, grad_partitions) -> list:
    """ZeRO-3 offload's ``partition_grads``, its gradient partitions moved to the host flat buffer in one transfer;
    after the first micro-step of an accumulation each is first added, on the device, to the sum the buffer holds
    (an upload). Upstream copies each partition to the host, back to the device and to the host again (into the
    optimizer's fp32 partition): a graph and two transfers per parameter. Here DeepSpeed's boundary work (the norm,
    the fp32 copy or the NVMe swap) reads the host copy."""
    views = optimizer._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
    kept = []
    for param, grad_partition in zip(params_to_release, grad_partitions):
        param.grad = None
        if param.partition_numel() * optimizer._get_param_partition_rank(param) < param.ds_numel:
            kept.append((param, grad_partition))  # else this rank's partition of the parameter is padding only
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
    for (param, _), buffer, values in zip(kept, held, _to_host_at_once(sums, dtype)):
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


def _sum_of_squares(gradients, dtype):
    """Σ g·g over ``gradients``, in ``dtype``: the squared L2 norm with one element operation per element.

    ``torch.linalg.vector_norm`` lowers to |g|, |g|² and a root per tensor on XLA, which DeepSpeed then squares
    again: two element operations per gradient element (the step graph's count, docs/performance.md 'Cost of a
    step'). The values differ from upstream's only by the rounding of each tensor's root and square.
    """
    import torch
    gradients = [grad.to(dtype) for grad in gradients]
    return torch.stack([square.sum() for square in torch._foreach_mul(gradients, gradients)]).sum()


def stage3_grad_norm(original):
    """ZeRO-3's gradient norm from the gradients' sum of squares (``_sum_of_squares``, foreach ops).

    Upstream traces three ops and a view replay per parameter (host work on XLA, every step) and takes each
    gradient's norm only to square it. Model- and expert-parallel runs and other norm types take the upstream path.
    """

    @functools.wraps(original)
    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        if float(norm_type) != 2.0 or self.model_parallel_group is not None or self.model_parallel_rank != 0 \
                or not gradients or any(grad.device.type != "xla" for grad in gradients) \
                or self._autoep_expert_parallel_group(params) is not None:
            return original(self, gradients, params, norm_type)
        import torch
        from deepspeed import comm as dist
        from deepspeed.runtime.zero.utils import get_norm_dtype
        self._assert_same_partition_group(params)
        total = _sum_of_squares(gradients, get_norm_dtype())
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._get_param_partition_group(params[0]))
        total = total**0.5
        invalid = total.isnan().logical_or(total.isinf())
        return torch.where(invalid, torch.tensor(-1.0, device=self.device, dtype=torch.float), total)

    return get_grad_norm_direct


def stage_1_and_2_grad_norm(original):
    """ZeRO-1/2's L2 gradient norm from the gradients' sum of squares (``_sum_of_squares``), the rest as upstream:
    the same gradients counted (padding, pipeline-replicated and other model-parallel ranks' parameters left out),
    the same all-reduces, an inf or NaN norm masked to -1. Other norm types and gradients off the device take the
    upstream path."""

    @functools.wraps(original)
    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        if float(norm_type) != 2.0 or not gradients or any(grad.device.type != "xla" for grad in gradients):
            return original(self, gradients, params, norm_type)
        upstream = original.__globals__  # the names the upstream method reads, from its own module
        dist, replicated = upstream["dist"], upstream["PIPE_REPLICATED"]
        counted = [grad for grad, param in zip((g for g in gradients if not getattr(g, "_zero_padding", False)),
                                               params)
                   if not (hasattr(param, replicated) and param.ds_pipe_replicated)
                   and (upstream["is_model_parallel_parameter"](param) or self.model_parallel_rank == 0)]
        if counted:
            total = _sum_of_squares(counted, upstream["get_norm_dtype"]()).float()
        else:
            import torch
            total = torch.tensor(0.0, dtype=torch.float32).to(self.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        total = total.pow(0.5)
        upstream["mask_nan_or_inf_with_val_inplace"](total, device=self.device)
        return total

    return get_grad_norm_direct


def _positional_apply(function_class) -> classmethod:
    """``Function.apply`` that skips binding the arguments to ``forward``'s signature when all are given.

    torch binds them with ``inspect.signature`` on every call of a Function defining ``setup_context``,
    which costs host time (docs/performance.md, 'Why the patches exist'). ZeRO-3 applies such Functions
    around every module's inputs and outputs and in every linear layer, each step; given every
    ``forward`` argument positionally, the binding returns them unchanged. Any other call, and any
    under torch.compile, takes torch's path.
    """
    import torch
    from torch._functorch.utils import unwrap_dead_wrappers
    arity = len(inspect.signature(function_class.forward).parameters)
    full_apply = torch.autograd.Function.apply.__func__

    def apply(cls, *args, **kwargs):
        if kwargs or len(args) != arity or torch._C._are_functorch_transforms_active() \
                or torch.compiler.is_compiling():
            return full_apply(cls, *args, **kwargs)
        return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))

    return classmethod(apply)


def zero3_linear_apply(original):
    """ZeRO-3's memory-efficient linear (``original`` is its bound ``apply``): ``_positional_apply``."""
    return _positional_apply(original.__self__)


def zero3_register_module(original):
    """ZeRO-3's per-module backward hooks: their autograd Functions (created here, one pair per module)
    get ``_positional_apply``."""

    @functools.wraps(original)
    def register_deepspeed_module(self, module, *args, **kwargs):
        original(self, module, *args, **kwargs)
        for name in ("pre_bwd_fn", "post_bwd_fn"):
            function_class = module.__dict__.get(name)
            if function_class is not None:
                function_class.apply = _positional_apply(function_class)

    return register_deepspeed_module


def stage_1_and_2_has_overflow(original):
    """ZeRO-1/2's bf16 overflow test (``check_grad_overflow``): left to the device when the norm covers it.

    Upstream all-reduces a per-rank overflow flag and reads it. The global gradient norm, which
    ``step_guard`` tests on the device, is inf or NaN whenever any gradient is, so with
    ``compute_grad_norm`` on (the default) the flag adds only a collective and a host read.
    """

    @functools.wraps(original)
    def has_overflow(self, partition_gradients=True):
        if self.compute_grad_norm and not self.cpu_offload:  # patched only under the XLA accelerator
            return False
        return original(self, partition_gradients)

    return has_overflow


def _onto_device(param, device) -> None:
    """Make a host parameter ``param`` an accelerator one in place: the same Python object (modules and the
    caller's references keep it), its attributes kept, its data on ``device``."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import is_zero_param
    if is_zero_param(param) or param.device.type == torch.device(device).type:
        return
    moved = torch.nn.Parameter(param.data.to(device), requires_grad=param.requires_grad)
    moved.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, moved)


def zero_init_moves_host_params(original):
    """``zero.Init`` moves a parameter made on the host (``torch.FloatTensor(5)``, a constructor its tensor-creation
    wrappers do not catch) with ``param.data = param.data.to(device)``, which torch refuses for an XLA tensor
    ("incompatible tensor type"). Such parameters are swapped onto the device first; upstream then finds them there.
    Wraps ``_post_init_method(module)`` and ``_convert_to_zero_parameters(params)``."""

    @functools.wraps(original)
    def method(self, module_or_params):
        import torch
        if isinstance(module_or_params, torch.nn.Module):
            params = list(module_or_params.parameters(recurse=False))
        else:
            params = module_or_params = list(module_or_params)  # often a generator: upstream iterates it again
        for param in params:
            _onto_device(param, self.local_device)
        return original(self, module_or_params)

    return method


# What ZeRO-1/2 offload leaves for the end of the backward (``_flush_offload_reads``), kept on the optimizer.
_OFFLOAD_PENDING = "_dsx_offload_pending"


def _offload_pending(optimizer) -> dict:
    return optimizer.__dict__.setdefault(_OFFLOAD_PENDING, {"copies": [], "overflow": []})


def stage_1_and_2_offload_copy(original):
    """ZeRO-1/2 offload: a gradient's copy into the host fp32 partition waits for the end of the backward.

    Upstream copies each parameter's gradient to the host as it is reduced: on XLA a graph, a compilation
    in the first steps and a device->host transfer per parameter. Here the gradient's value is taken now
    (a copy, not a view of a reduction bucket a later bucket overwrites) and ``_flush_offload_reads``
    moves all of them in one transfer.
    """

    @functools.wraps(original)
    def copy(self, param):
        grad = self.get_param_gradient_attribute(param)
        if grad is None or grad.device.type != "xla":
            return original(self, param)
        group, source_offset, dest_offset, numel = self.grad_position[self.get_param_id(param)]
        dest = self.single_partition_of_fp32_groups[group].grad.view(-1).narrow(0, dest_offset, numel)
        source = grad.view(-1).narrow(0, source_offset, numel).to(self.master_weights_and_grads_dtype)
        _offload_pending(self)["copies"].append((dest, source.clone()))
        self.clear_grad_attribute(param)

    return copy


def stage_1_and_2_offload_accumulate(original):
    """ZeRO-1/2 offload with gradient accumulation: a micro-step's sum reaches the host buffer at the end of the
    backward, in the one transfer of ``_flush_offload_reads``.

    Upstream adds the host buffer into each parameter's gradient on the device and copies the sum back to it as
    the parameter is reduced: on XLA a graph, compilations in the first steps and a transfer per parameter and
    micro-step. The buffer is still read as each parameter is reduced (an upload, no graph); only the copy back waits.
    """

    @functools.wraps(original)
    def accumulate(self, param):
        grad = self.get_param_gradient_attribute(param)
        if grad is None or grad.device.type != "xla":
            return original(self, param)
        import torch
        from deepspeed.accelerator import get_accelerator
        param_id = self.get_param_id(param)
        group, source_offset, dest_offset, numel = self.grad_position[param_id]
        if self.low_precision_master_weights_and_grads:  # the host keeps only this rank's part, in the fp32 grads
            held = self.single_partition_of_fp32_groups[group].grad.view(-1).narrow(0, dest_offset, numel)
            summed = grad.data.view(-1).narrow(0, source_offset, numel)
        else:
            held = self.accumulated_grads_in_cpu.get(param_id)
            if held is None:
                held = torch.zeros(param.numel(), dtype=param.dtype, device="cpu")
                held = get_accelerator().pin_memory(held) if self.cpu_offload_pin_memory else held
            summed = grad.data.view(-1)
        self.accumulated_grads_in_cpu.setdefault(param_id, held)
        if self.micro_step_id > 0:
            summed.add_(held.to(summed.device, summed.dtype))
        _offload_pending(self)["copies"].append((held, summed.clone()))

    return accumulate


def stage_1_and_2_offload_overflow(original):
    """ZeRO-1/2 offload: a gradient's overflow test is read with the gradients (upstream reads each on its own)."""

    @functools.wraps(original)
    def update_offload_overflow_tracker(self, grad):
        if grad is None or grad.device.type != "xla":
            return original(self, grad)
        _offload_pending(self)["overflow"].append(self._has_inf_or_nan(grad.data))

    return update_offload_overflow_tracker


def _flush_offload_reads(optimizer) -> None:
    """One device->host transfer for what ZeRO-1/2 offload reads per parameter: the deferred gradient copies, the
    overflow tests, and the per-parameter gradient norms, which upstream's norm then sums on the host."""
    pending = optimizer.__dict__.pop(_OFFLOAD_PENDING, None)
    if not pending:
        return
    import torch
    norms = {key: norm for key, norm in optimizer.norm_for_param_grads.items() if norm.device.type == "xla"}
    copies, flags = pending["copies"], pending["overflow"]
    values = iter(_to_host_at_once([source for _, source in copies] + [*norms.values(), *flags], torch.float32))
    for dest, _ in copies:
        dest.copy_(next(values))
    for key, norm in norms.items():
        optimizer.norm_for_param_grads[key] = next(values)[0].to(norm.dtype)
    if flags and any(flag.item() for flag in values):
        optimizer.local_overflow = True


def stage_1_and_2_offload_flush(original):
    """Ends the backward of ZeRO-1/2 offload (``independent_gradient_partition_epilogue``, and
    ``_finalize_cpu_offload_gradient_accumulation`` when the engine does not manage the backward) with the reads
    ``stage_1_and_2_offload_copy`` and ``stage_1_and_2_offload_overflow`` deferred."""

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        _flush_offload_reads(self)
        return result

    return method
