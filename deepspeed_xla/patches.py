"""Every run-time change to DeepSpeed internals, in one place, each guarded by the version it was written for.

The startup hook calls ``on_module_loaded`` as each target module finishes importing, and only when
the XLA accelerator is active. ``tests/test_patches.py`` fails when an upstream target changes.
"""
import contextlib
import functools
import hashlib
import inspect
import warnings
from importlib import metadata
from typing import Callable, NamedTuple, Tuple

WRITTEN_FOR = "0.19.8"


@contextlib.contextmanager
def keep_parameter_objects():
    """Make ``module.to(xla)`` swap tensor contents into the existing Parameter objects.

    A CPU Parameter cannot take an XLA tensor as ``.data``, so torch replaces the Parameter, and the
    optimizer (built from the user's ``model.parameters()``) keeps training the stale CPU tensors.
    """
    import torch
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def _engine_configure_distributed_model(original):

    @functools.wraps(original)
    def configure(self, model):
        from deepspeed.utils import debug
        # DeepSpeed's debug name maps hold weakrefs to every parameter, and swapping refuses weakref'd
        # tensors: drop the maps for the move and rebuild them (ids do not change) afterwards.
        debug.debug_clear_module_and_param_names()
        try:
            with keep_parameter_objects():
                return original(self, model)
        finally:
            debug.debug_extract_module_and_param_names(model)

    return configure


def _engine_sync_after(original):
    """End the lazy graph when ``original`` returns.

    ``_take_model_step``: one XLA execution per step, bounded graph size. DeepSpeed never marks steps
    (eager devices need no marker); without one the traced graph grows across steps until the
    compiler runs out of memory. The pipeline engine steps here too.

    ``load_checkpoint``: the load leaves lazy computations over the freshly loaded buffers (ZeRO-3
    rebuilds its partitions and gathered parameters from them). Left to the first step, one of them
    reads a partition-sized buffer that step donates to an in-place update, and the second step
    fails with "buffer ... is deleted" (seen with 2 ranks; gone with XLA_ENABLE_PARAM_ALIASING=0 or
    this sync). Materialized here, the first step starts from device data, as after initialize.
    """

    @functools.wraps(original)
    def sync_after(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        from deepspeed_xla import xla_runtime
        xla_runtime.sync(wait=False)
        return result

    return sync_after


def _engine_configure_zero_optimizer(original):
    """Fit ZeRO's gradient buffers to XLA before ZeRO allocates them.

    Bucket sizes: ZeRO allocates its gradient buckets with ``torch.empty(reduce_bucket_size)``
    (default 5e8 elements) every step. CUDA leaves untouched memory unbacked; XLA materializes the
    whole buffer, which on a small model is gigabytes of zeros per step. A bucket never holds more
    than every parameter, so capping the sizes at the parameter count changes no result.

    ``contiguous_gradients`` off unless the config sets it: the option copies each gradient into a
    slice of a flat bucket to spare CUDA's allocator fragmentation. torch_xla lowers each such copy
    as a select over the whole bucket, so a step does work of (parameters x bucket) elements: on a
    6M-parameter, 100-tensor model ZeRO-1 ran 4.1x and ZeRO-2 39x the floor's step time, against
    1.2x and 1.0x with the option off (docs/performance.md). Off, ZeRO concatenates the gradients
    once (same values). MoE layers need it on in ZeRO-2, so they keep DeepSpeed's default.
    """

    @functools.wraps(original)
    def configure(self, optimizer):
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in self.module.parameters())
        numel += numel % 2  # ZeRO-1/2 assert an even all-gather bucket (4-byte alignment of 16-bit elements)
        zero = self._config.zero_config
        for field in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
            if getattr(zero, field, 0) > numel:
                setattr(zero, field, numel)
        if "contiguous_gradients" not in zero.model_fields_set and not self.has_moe_layers:
            zero.contiguous_gradients = False
        return original(self, optimizer)

    return configure


def _stage3_partition_grads(original):
    """ZeRO-3: write a bucket's gradient partitions into the flat gradient buffer with one update.

    Upstream copies each partition into its slice of ``grad_partitions_flat_buffer``. torch_xla
    lowers every copy into a slice as a select over the whole buffer (pytorch/xla#4791), so a step
    did (parameters x buffer) element operations, like ``contiguous_gradients`` in ZeRO-1/2. Here
    the new buffer is concatenated from the partitions and the untouched spans and copied in once;
    the per-parameter views DeepSpeed reads afterwards see the same values. Offloaded gradients
    live in host memory and keep the upstream path. Relies on the buffer's layout, which ``__init__``
    builds in ``fp16_groups`` order (``_flat_offsets``).
    """

    @functools.wraps(original)
    def partition_grads(self, params_to_release, grad_partitions):
        flat = self.grad_partitions_flat_buffer
        if self.offload_optimizer or flat.device.type != "xla":
            return original(self, params_to_release, grad_partitions)
        import torch
        offsets = _flat_offsets(self)
        views = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        accumulate = self.micro_step_id != 0
        spans, buffers = [], []
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
        # Tracing is the cost here (each op is host work): gaps of zero length add no piece.
        pieces, end = [], 0
        for offset, numel, grad in sorted(spans, key=lambda span: span[0]):
            if offset > end:
                pieces.append(flat.narrow(0, end, offset - end))
            pieces.append(grad)
            end = offset + numel
        if end < flat.numel():
            pieces.append(flat.narrow(0, end, flat.numel() - end))
        if spans:
            flat.copy_(torch.cat(pieces))
        return buffers

    return partition_grads


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


def _stage3_fp32_grad_from_flat_buffer(original):
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


def _stage3_grad_norm(original):
    """ZeRO-3's gradient norm with the per-parameter norms in one ``_foreach_norm``.

    Upstream traces three ops and a view replay per parameter (host work on XLA, every step); the
    foreach form reduces each gradient alike, so the norms are the same. Model- and expert-parallel
    runs and other norm types take the upstream path.
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
        norms = torch._foreach_norm([grad.to(get_norm_dtype()) for grad in gradients], 2.0)
        total = torch.sum(torch.pow(torch.stack(norms), 2.0))
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._get_param_partition_group(params[0]))
        total = total**0.5
        invalid = total.isnan().logical_or(total.isinf())
        return torch.where(invalid, torch.tensor(-1.0, device=self.device, dtype=torch.float), total)

    return get_grad_norm_direct


def _positional_apply(function_class) -> classmethod:
    """``Function.apply`` that skips binding the arguments to ``forward``'s signature when all are given.

    torch binds them with ``inspect.signature`` on every call of a Function defining ``setup_context``
    (~15 us of host time). ZeRO-3 applies such Functions around every module's inputs and outputs and
    in every linear layer, each step; given every ``forward`` argument positionally, the binding
    returns them unchanged. Any other call, and any under torch.compile, takes torch's path.
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


def _zero3_linear_apply(original):
    """ZeRO-3's memory-efficient linear (``original`` is its bound ``apply``): ``_positional_apply``."""
    return _positional_apply(original.__self__)


def _zero3_register_module(original):
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


def _has_inf_or_nan(original):
    """Test every element: DeepSpeed's ``isfinite(x.amax())`` trick is wrong on XLA twice over.

    torch_xla 2.9's ``amax()``/``amin()`` without ``dim`` do not reduce (the in-place accumulation into
    a 1-element counter then fails: bf16 ZeRO-1/2, fp16 loss scaling), and XLA's max reduction drops
    NaN instead of propagating it. XLA fuses the elementwise test into the reduction, so no mask is
    materialized (the cost the upstream trick avoids on eager devices).
    """

    @functools.wraps(original)
    def has_inf_or_nan(x):
        if x.device.type != "xla" or x.is_sparse or x.numel() == 0:
            return original(x)
        import torch
        return torch.isfinite(x).all().logical_not()

    return has_inf_or_nan


def _clip_tensors_by_global_norm(original):
    """Scale by ``min(1, max_norm / (norm + eps))`` on the device instead of testing ``clip_coef < 1`` on the host.

    The host test reads the norm (an extra graph execution every step) and puts a different graph
    in the step whenever clipping switches on or off: a recompilation mid-run (bf16 optimizer,
    pipeline engine). Multiplying by exactly 1.0 leaves unclipped gradients bit-identical.
    """

    @functools.wraps(original)
    def clip_tensors_by_global_norm(input_tensors, max_norm=1.0, global_norm=None, mpu=None, eps=1e-6):
        import torch
        if global_norm is None:
            from deepspeed.runtime.utils import get_global_norm_of_tensors
            global_norm = get_global_norm_of_tensors(input_tensors, mpu=mpu)
        if not torch.is_tensor(global_norm) or global_norm.device.type != "xla":
            return original(input_tensors, max_norm, global_norm, mpu, eps)
        clip_coef = torch.clamp(max_norm / (global_norm + eps), max=1.0)
        for tensor in input_tensors:
            tensor.detach().mul_(clip_coef)
        return global_norm

    return clip_tensors_by_global_norm


def _is_invalid_grad_norm(original):
    """Leave an XLA norm to the device: ``step_guard`` discards the step's update in the graph instead.

    The host test reads the norm every step (a second graph execution and a device->host transfer).
    ``_engine_configure_optimizer`` guards the optimizer steps of the ZeRO and bf16 wrappers, the
    only callers of the patched bindings.
    """

    @functools.wraps(original)
    def is_invalid_grad_norm(norm):
        from deepspeed_xla import step_guard
        return False if step_guard.is_device_checked(norm) else original(norm)

    return is_invalid_grad_norm


def _fp16_optimizer_step(original):
    """bf16 without ZeRO (``FP16_Optimizer``): copy the updated fp32 master weights to the bf16 ones at once.

    Upstream copies them parameter by parameter, and each parameter is a view of the flat bf16 buffer:
    torch_xla lowers each copy as a select over the whole buffer (as ``_stage3_partition_grads``).
    Copied whole afterwards, the flat buffer no longer depends on those copies, so they drop out of
    the graph; the parameters, still its views, read the same values.
    """

    @functools.wraps(original)
    def step(self, closure=None):
        overflow = original(self, closure)
        if not overflow and not self.fused_adam_legacy:  # upstream's per-parameter copies ran
            for low_precision, master in zip(self.fp16_groups_flat, self.fp32_groups_flat):
                if low_precision.device.type == "xla":
                    low_precision.copy_(master)
        return overflow

    return step


def _bf16_optimizer_update_hp_grads(original):
    """``BF16_Optimizer`` (bf16 pipelines; bf16 ZeRO-1 with fp32 gradient accumulation): add each group's
    gradients to its flat fp32 gradient buffer with one addition.

    Upstream (``_update_hp_grad``) adds each parameter's gradient to its view of the buffer, after every
    backward: one select over the whole buffer per parameter on XLA (as ``_stage3_partition_grads``).
    """

    @functools.wraps(original)
    def update_hp_grads(self, clear_lp_grads=False):
        flats = self.fp32_groups_gradients_flat
        if self.immediate_grad_update or self.autoep_folding_tp_group is not None or not flats \
                or flats[0].device.type != "xla":
            return original(self, clear_lp_grads)
        import torch
        with torch.no_grad():
            for i, group in enumerate(self.bf16_groups):
                flat, hp_grads = flats[i], self.fp32_groups_gradients[i]
                grads = [lp.grad for lp in group]
                if all(grad is None for grad in grads):
                    continue
                pieces = [flat.new_zeros(hp.numel()) if grad is None else grad.to(flat.dtype).reshape(-1)
                          for grad, hp in zip(grads, hp_grads)]
                padding = flat.numel() - sum(hp.numel() for hp in hp_grads)
                flat.add_(torch.cat(pieces + [flat.new_zeros(padding)]))
                for j, (lp, grad) in enumerate(zip(group, grads)):
                    if grad is not None:
                        lp._hp_grad = hp_grads[j]
                        self.fp32_groups_has_gradients[i][j] = True
                        if clear_lp_grads:
                            grad.zero_()

    return update_hp_grads


def _bf16_optimizer_grads_for_clipping(original):
    """``BF16_Optimizer``: clip the flat fp32 gradient buffers rather than each parameter's view of them.

    Scaling a view in place is a select over the whole buffer on XLA. The buffers hold only those
    gradients, alignment padding and the zeros of parameters without a gradient since the last step
    (``clear_hp_grads`` zeroes them every step), so scaling them whole clips the same values.
    """

    @functools.wraps(original)
    def get_grads_for_norm(self, for_clipping=False):
        flats = self.fp32_groups_gradients_flat
        if for_clipping and flats and flats[0].device.type == "xla":
            return list(flats)
        return original(self, for_clipping)

    return get_grads_for_norm


def _zero_has_overflow(original):
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


def _fp16_optimizer_overflow_checker(original):
    """bf16 without ZeRO (``FP16_Optimizer``): leave its per-gradient overflow test to the device.

    Upstream reads one flag per gradient (a graph execution each). The step's gradient norm, which
    ``step_guard`` tests on the device, is inf or NaN whenever a gradient is. Patched only in the
    module binding ``FP16_Optimizer`` uses; fp16 itself is rejected on XLA (``config_checks``).
    """

    class DeviceCheckedOverflow(original):

        def has_overflow(self, params, has_moe_params=None):
            if params and all(p.grad is None or p.grad.device.type == "xla" for p in params):
                return False
            return super().has_overflow(params, has_moe_params)

    DeviceCheckedOverflow.__qualname__ = DeviceCheckedOverflow.__name__ = original.__name__
    DeviceCheckedOverflow.__wrapped__ = original  # what upstream_digest reads
    return DeviceCheckedOverflow


def _get_flattened_grad_norm(original):
    """The 2-norm of the gradients as a device tensor; upstream reads each parameter's norm.

    inf and NaN stay as they are where upstream returns its -1 sentinel: both are invalid norms.
    Index masks (tensor-parallel duplicates) and other norm types take the upstream path.
    """

    @functools.wraps(original)
    def get_flattened_grad_norm(parameters, norm_type=2, mpu=None, grad_norm_mask=None):
        import torch
        params = [p for p in ([parameters] if torch.is_tensor(parameters) else parameters) if p.grad is not None]
        masked = grad_norm_mask is not None and any(len(mask) for mask in grad_norm_mask)
        if not params or masked or float(norm_type) != 2.0 or any(p.grad.device.type != "xla" for p in params):
            return original(parameters, norm_type, mpu, grad_norm_mask)
        total = torch.stack([p.grad.detach().float().norm(2) for p in params]).square().sum()
        if mpu is not None:
            from deepspeed import comm as dist
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
        return total.sqrt()

    return get_flattened_grad_norm


def _get_global_norm(original):
    """Combine device norms on the device: upstream tests each on the host and takes ``math.sqrt``."""

    @functools.wraps(original)
    def get_global_norm(norm_list):
        from deepspeed_xla import step_guard
        device_norms = [norm for norm in norm_list if step_guard.is_device_checked(norm)]
        if not device_norms:
            return original(norm_list)
        import torch
        device = device_norms[0].device
        norms = torch.stack([torch.as_tensor(norm, dtype=torch.float32).to(device) for norm in norm_list])
        valid = step_guard.valid_norm(norms)
        return torch.where(valid, norms.square().sum().sqrt(), torch.tensor(float("inf"), device=norms.device))

    return get_global_norm


def _fp16_optimizer_unscale_and_clip_grads(original):
    """``clip = max(clip, 1)`` on the device instead of testing ``clip > 1`` on the host (same values)."""

    @functools.wraps(original)
    def unscale_and_clip_grads(self, grad_groups_flat, total_norm, apply_scale=True):
        import torch
        if self.clip_grad <= 0. or not torch.is_tensor(total_norm) or total_norm.device.type != "xla":
            return original(self, grad_groups_flat, total_norm, apply_scale)
        cur_scale = self.loss_scale_config.cur_scale
        clip = torch.clamp(((total_norm / cur_scale) + 1e-6) / self.clip_grad, min=1.0)
        combined_scale = clip * cur_scale
        if apply_scale:
            for grad in grad_groups_flat:
                grad.data.mul_(1. / combined_scale)
        return combined_scale

    return unscale_and_clip_grads


SKIPPED_STEPS = "xla_skipped_steps"


def _device_skipped_steps(engine) -> int:
    counter = getattr(getattr(engine, "optimizer", None), SKIPPED_STEPS, None)
    return 0 if counter is None else int(counter.item())


def _engine_skipped_steps(_upstream_has_none):
    """``engine.skipped_steps`` counts the steps ``step_guard`` skipped on the device too.

    Upstream keeps an instance counter that ``_take_model_step`` bumps when the optimizer reports an
    overflow; on XLA the optimizers no longer report one. The device count is read only when
    something reads the attribute: DeepSpeed's progress log every ``steps_per_print`` steps, a
    checkpoint save, the user.
    """

    def get(self) -> int:
        return self.__dict__.get("_host_skipped_steps", 0) + _device_skipped_steps(self)

    def set(self, value: int) -> None:
        self.__dict__["_host_skipped_steps"] = value - _device_skipped_steps(self)

    return property(get, set, doc=_engine_skipped_steps.__doc__)


def _engine_configure_optimizer(original):
    """Guard the inner optimizer of every wrapper whose ``is_invalid_grad_norm`` test moved to the device.

    The wrapper's ``xla_skipped_steps``, a device tensor, counts the steps discarded because the
    gradient norm was invalid; ``engine.skipped_steps`` adds it in.
    """

    @functools.wraps(original)
    def configure(self, client_optimizer, model_parameters):
        original(self, client_optimizer, model_parameters)
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        wrapper = self.optimizer
        if isinstance(wrapper, (BF16_Optimizer, FP16_Optimizer, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
            from deepspeed_xla import step_guard

            def count(skipped):
                previous = getattr(wrapper, SKIPPED_STEPS, None)
                setattr(wrapper, SKIPPED_STEPS, skipped.long() if previous is None else previous + skipped.long())

            step_guard.guard_step(wrapper.optimizer, lambda: wrapper._global_grad_norm, count)

    return configure


def _engine_create_checkpoint_engine(original):
    """Give DeepSpeed's checkpoint engine CPU tensors: checkpoints written on XLA load without torch_xla."""

    @functools.wraps(original)
    def create_checkpoint_engine(*args, **kwargs):
        from deepspeed_xla.checkpoint import CpuCheckpointEngine
        return CpuCheckpointEngine(original(*args, **kwargs))

    return create_checkpoint_engine


def _engine_get_shared_params(original):
    """Name tied parameters by Parameter identity: XLA tensors have no storage pointer.

    Upstream finds shared weights by ``param.data_ptr()``, which is 0 for every XLA tensor, so every
    parameter looks shared with the first one and ``zero_to_fp32`` writes the first parameter's values
    under every name. Tied weights are one Parameter object reached under several names. ZeRO-3
    identifies them by ``ds_id`` upstream and is left as it is.
    """

    @functools.wraps(original)
    def get_shared_params(self):
        from deepspeed import comm as dist
        if self.zero_optimization_partition_weights() or dist.get_rank() != 0:
            return original(self)
        first_name, shared = {}, {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            if id(param) in first_name:
                shared[name] = first_name[id(param)]
            else:
                first_name[id(param)] = name
        return shared

    return get_shared_params


def _engine_save_checkpoint(original):
    """Write ``latest`` only once every rank's files are on disk, and atomically.

    Upstream rank 0 writes ``latest`` before the final barrier, so it can name a checkpoint another
    rank is still writing (or dies writing). The upstream save ends with a barrier that every rank
    reaches after its files; ``latest`` goes after it, then a barrier as upstream. Decoupled
    (asynchronous) checkpoint engines write ``latest`` when they commit and are left as they are.
    """

    @functools.wraps(original)
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        client_state = {} if client_state is None else client_state
        if self.checkpoint_engine.is_decoupled():
            return original(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        result = original(self, save_dir, tag, client_state, False, exclude_frozen_parameters)
        if save_latest:
            from deepspeed import comm as dist
            from deepspeed_xla.checkpoint import write_latest
            if self.global_rank == 0:
                write_latest(save_dir, tag)
            dist.barrier()
        return result

    return save_checkpoint


def _config_configure_train_batch_size(original):
    """Refuse settings XLA cannot run (``config_checks``) as DeepSpeed parses the config, before it derives
    batch sizes or builds anything; and explain DeepSpeed's bare batch-size assertion with the fix."""

    @functools.wraps(original)
    def configure_train_batch_size(self):
        from deepspeed_xla import config_checks
        config_checks.check_config(self)
        try:
            return original(self)
        except AssertionError:
            config_checks.check_batch_size(self)
            raise

    return configure_train_batch_size


def _config_timers_without_device_wait(original):
    """The throughput timer waits for the device only if the config asks (``timers.throughput.synchronized``).

    DeepSpeed's default waits at the start and the end of every step, for exact step times on CUDA. On XLA
    the wait stops the host from tracing the next step while the device runs this one, the overlap lazy
    execution lives on; memory stays bounded without it, since torch_xla's next ``sync()`` waits for the
    previous execution. Unwaited, the timer reports the host's pace, which is the device's once steady.
    """

    @functools.wraps(original)
    def get_timers_config(param_dict):
        config = original(param_dict)
        if "synchronized" not in config.model_fields_set:
            config.synchronized = False
        return config

    return get_timers_config


_ENV_FILE_NAME = ".deepspeed_env"


@functools.lru_cache(maxsize=None)
def _normalized_env_dir() -> str:
    """One clean ``.deepspeed_env`` holding what our parser read from the user's files, or "" if none."""
    import os
    import tempfile
    from deepspeed_xla.env_file import merged_env_values
    merged = merged_env_values()
    if not merged:
        return ""
    folder = tempfile.mkdtemp(prefix="deepspeed_xla_env_")
    with open(os.path.join(folder, _ENV_FILE_NAME), "w") as handle:
        handle.writelines(f"{key}={value}\n" for key, value in merged.items())
    return folder


def _runner_env_paths(original):
    """Multi-node runs: DeepSpeed's runner re-reads ``.deepspeed_env`` with a parser that fails on blank
    lines and comments; point it at a normalized copy of what deepspeed_xla already parsed."""
    folder = _normalized_env_dir()
    return [folder] if folder else original


def _runner_env_name(original):
    return _ENV_FILE_NAME if _normalized_env_dir() else original


class Patch(NamedTuple):
    module: str
    #: Class holding ``attr``, or "" for a module-level name.
    owner: str
    attr: str
    #: Called with the upstream value; returns the replacement.
    wrapper: Callable
    #: sha256 prefix of the upstream source the wrapper was written against.
    digest: str
    #: The functions of ``owner`` the patch relies on, when not (only) ``attr``: for a data attribute, the
    #: function using it; for a wrapper that re-implements a callee, both. The digest is of their sources.
    reads: Tuple[str, ...] = ()


# DeepSpeed imports has_inf_or_nan by name, so every importing module's binding is patched.
_HAS_INF_OR_NAN_DIGEST = "f2891c8e640be50c"

_FP16_OPTIMIZER = "deepspeed.runtime.fp16.fused_optimizer"

PATCHES = [
    *(Patch(module, "", "has_inf_or_nan", _has_inf_or_nan, _HAS_INF_OR_NAN_DIGEST)
      for module in ("deepspeed.runtime.utils", "deepspeed.runtime.zero.stage_1_and_2",
                     "deepspeed.runtime.zero.stage3", "deepspeed.runtime.fp16.loss_scaler")),
    *(Patch(module, "", "clip_tensors_by_global_norm", _clip_tensors_by_global_norm, "7acb1d9576311c93")
      for module in ("deepspeed.runtime.utils", "deepspeed.runtime.bf16_optimizer")),
    *(Patch(module, "", "is_invalid_grad_norm", _is_invalid_grad_norm, "6afd483e2c88e25e")
      for module in ("deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
                     "deepspeed.runtime.bf16_optimizer", _FP16_OPTIMIZER)),
    Patch(_FP16_OPTIMIZER, "", "CheckOverflow", _fp16_optimizer_overflow_checker, "ad6225ec62eec6f0"),
    Patch(_FP16_OPTIMIZER, "", "get_flattened_grad_norm", _get_flattened_grad_norm, "0ac9d7bf88d477dc"),
    Patch(_FP16_OPTIMIZER, "", "get_global_norm", _get_global_norm, "2279a25f9445daa5"),
    Patch("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer", "update_hp_grads", _bf16_optimizer_update_hp_grads,
          "2e3323daf69099fd", reads=("update_hp_grads", "_update_hp_grad", "_setup_for_real_optimizer")),
    Patch("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer", "get_grads_for_norm",
          _bf16_optimizer_grads_for_clipping, "f50a60eac0fc1b77",
          reads=("get_grads_for_norm", "step", "clear_hp_grads")),
    Patch(_FP16_OPTIMIZER, "FP16_Optimizer", "step", _fp16_optimizer_step, "d3311d0b03f4d4db",
          reads=("step", "__init__")),
    Patch(_FP16_OPTIMIZER, "FP16_Optimizer", "unscale_and_clip_grads", _fp16_optimizer_unscale_and_clip_grads,
          "87c72c13927c20de"),
    Patch("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "has_overflow", _zero_has_overflow,
          "cadc27a13cb7e977"),
    Patch("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "partition_grads",
          _stage3_partition_grads, "737384307101960d", reads=("partition_grads", "__init__")),
    Patch("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_prepare_fp32_grad_for_sub_group",
          _stage3_fp32_grad_from_flat_buffer, "78ffebc682040ac1",
          reads=("_prepare_fp32_grad_for_sub_group", "independent_gradient_partition_epilogue", "__init__")),
    Patch("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "get_grad_norm_direct", _stage3_grad_norm,
          "89aab0f80f1a80b3"),
    Patch("deepspeed.runtime.zero.linear", "LinearFunctionForZeroStage3", "apply", _zero3_linear_apply,
          "a2d46ec1bf4107fd", reads=("forward", "setup_context")),
    Patch("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "_register_deepspeed_module",
          _zero3_register_module, "05081f6e841fa219"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "skipped_steps", _engine_skipped_steps, "c4c6e01aa1fc4e7d",
          reads=("_take_model_step", )),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_configure_optimizer", _engine_configure_optimizer,
          "dd82a70f2f92fe12"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_configure_distributed_model",
          _engine_configure_distributed_model, "a9a57b807f5eed72"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_configure_zero_optimizer",
          _engine_configure_zero_optimizer, "f31cf07a5d4f4170"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_take_model_step", _engine_sync_after,
          "c4c6e01aa1fc4e7d"),
    Patch("deepspeed.runtime.engine", "", "create_checkpoint_engine", _engine_create_checkpoint_engine,
          "1adbe5fc9cc0c1d1"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "save_checkpoint", _engine_save_checkpoint,
          "c92409217281487c"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_get_shared_params", _engine_get_shared_params,
          "7ca3cfe76bcd4439"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "load_checkpoint", _engine_sync_after, "5728d3dfa42a3d6c"),
    Patch("deepspeed.runtime.config", "DeepSpeedConfig", "_configure_train_batch_size",
          _config_configure_train_batch_size, "5d0a45deff9d4487"),
    Patch("deepspeed.runtime.config", "", "get_timers_config", _config_timers_without_device_wait,
          "f497cad4ad72df4f"),
    Patch("deepspeed.launcher.runner", "", "DEEPSPEED_ENVIRONMENT_PATHS", _runner_env_paths, "d40ac82930b5b28f",
          reads=("main", )),
    Patch("deepspeed.launcher.runner", "", "DEEPSPEED_ENVIRONMENT_NAME", _runner_env_name, "d40ac82930b5b28f",
          reads=("main", )),
]

PATCHED_MODULES = sorted({p.module for p in PATCHES})


def source_digest(*funcs) -> str:
    return hashlib.sha256("".join(inspect.getsource(func) for func in funcs).encode()).hexdigest()[:16]


def _xla_is_active() -> bool:
    from deepspeed.accelerator import real_accelerator
    return getattr(real_accelerator.ds_accelerator, "_name", None) == "xla"


def on_module_loaded(module) -> None:
    """Startup-hook entry: patch ``module`` if the XLA accelerator is DeepSpeed's accelerator."""
    if not _xla_is_active():
        return
    installed = metadata.version("deepspeed")
    if installed != WRITTEN_FOR:
        warnings.warn(f"deepspeed_xla's patches were written for DeepSpeed {WRITTEN_FOR}, found {installed}: "
                      f"install deepspeed=={WRITTEN_FOR}.")
    for patch in PATCHES:
        if patch.module == module.__name__:
            _apply(module, patch)


_applied = set()


def _owner(patch: Patch):
    import importlib
    module = importlib.import_module(patch.module)
    return getattr(module, patch.owner) if patch.owner else module


def upstream_digest(patch: Patch) -> str:
    """Digest of the upstream code the patch depends on, whether or not the patch is applied."""
    owner = _owner(patch)
    return source_digest(*(inspect.unwrap(getattr(owner, name)) for name in patch.reads or (patch.attr, )))


def is_applied(patch: Patch) -> bool:
    return patch in _applied


def _apply(module, patch: Patch) -> None:
    if patch in _applied:
        return
    if upstream_digest(patch) != patch.digest:
        warnings.warn(f"deepspeed_xla: {patch.module}.{patch.owner}.{patch.attr} differs from DeepSpeed "
                      f"{WRITTEN_FOR}; patched anyway, re-check deepspeed_xla/patches.py against this DeepSpeed.")
    owner = _owner(patch)
    setattr(owner, patch.attr, patch.wrapper(getattr(owner, patch.attr, None)))
    _applied.add(patch)


def apply_all() -> None:
    """Patch every target module that is already imported (the explicit ``register()`` route)."""
    import sys
    for name in PATCHED_MODULES:
        if name in sys.modules:
            on_module_loaded(sys.modules[name])
