"""Patches of DeepSpeed's ZeRO (``deepspeed.runtime.zero``): the gradient norms, ZeRO-3's autograd Functions and
module registration, ZeRO-1/2's overflow, gradient conversion and offloaded gradients, and ``zero.Init``'s move of
parameters made on the host (ZeRO-3's flat gradient buffer: ``zero3_grads``).

ZeRO-3's autograd Functions pay torch's argument binding on every call: host work per module, every step. ZeRO-1/2
all-reduce and read an overflow flag the device-side step guard already covers. With the optimizer offloaded, every
stage moves gradients to the host one parameter at a time. These wrappers do the same work once per buffer, or leave
it to the device, with the same values.
"""
import functools
import inspect


def to_host_at_once(tensors, dtype) -> list:
    """Host copies of XLA ``tensors``, flattened and as ``dtype``, from one graph execution and one transfer."""
    import torch
    from deepspeed_xla import xla_runtime
    flat = torch.cat([tensor.reshape(-1).to(dtype) for tensor in tensors])
    return list(xla_runtime.to_host([flat])[0].split([tensor.numel() for tensor in tensors]))


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


def stage_1_and_2_converts_grads_once(original):
    """ZeRO-1/2 with bf16 or fp16 gradients: each is converted to the fp32 partition's dtype once, for both the norm
    and the flat partition the optimizer steps.

    Upstream converts every gradient element twice in the step graph: per tensor in ``get_grad_norm_direct``
    and again when ``step`` converts the flattened partition (docs/performance.md, 'Cost of a step'). Here the
    partition's gradients are replaced by their converted copies before the norm (wraps ``scaled_global_norm``,
    which ``step`` calls before flattening them); the conversion is exact, so every value is upstream's. A
    preflattened partition (fp32 accumulation) and gradients off the device are left as they are.
    """

    @functools.wraps(original)
    def scaled_global_norm(self, norm_type=2):
        if not self.cpu_offload:
            for index, master in enumerate(self.single_partition_of_fp32_groups):
                gradients = self.averaged_gradients.get(index)
                if type(gradients) is list and gradients and all(
                        grad.device.type == "xla" and grad.dtype != master.dtype for grad in gradients):
                    self.averaged_gradients[index] = [_converted(grad, master.dtype) for grad in gradients]
        return original(self, norm_type)

    return scaled_global_norm


def _converted(grad, dtype):
    """``grad`` as ``dtype``, still marked as ZeRO's padding where it was (the norm leaves padding out)."""
    converted = grad.to(dtype)
    if getattr(grad, "_zero_padding", False):
        converted._zero_padding = True
    return converted


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
    values = iter(to_host_at_once([source for _, source in copies] + [*norms.values(), *flags], torch.float32))
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
