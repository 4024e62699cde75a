"""Patches of DeepSpeed's mixed-precision optimizers: ``FP16_Optimizer`` (bf16 without ZeRO),
``FP16_UnfusedOptimizer`` (the same with an optimizer DeepSpeed does not fuse, such as a torch one), ``BF16_Optimizer``.

They update, clip and test their flat buffers one parameter view at a time (a whole-buffer select each
on XLA) and read the gradient norm and overflow flags on the host (a graph execution each). These
wrappers write each flat buffer once and keep the norm, the overflow test and the clipping on the
device, where ``step_guard`` tests the norm.
"""
import functools


def fp16_optimizer_step(original):
    """bf16 without ZeRO (``FP16_Optimizer``): copy the updated fp32 master weights to the bf16 ones at once.

    Upstream copies them parameter by parameter, and each parameter is a view of the flat bf16 buffer:
    torch_xla lowers each copy as a select over the whole buffer (as ``zero3_grads.stage3_partition_grads``).
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


def bf16_optimizer_update_hp_grads(original):
    """``BF16_Optimizer`` (bf16 pipelines; bf16 ZeRO-1 with fp32 gradient accumulation): add each group's
    gradients to its flat fp32 gradient buffer with one addition.

    Upstream (``_update_hp_grad``) adds each parameter's gradient to its view of the buffer, after every
    backward: one select over the whole buffer per parameter on XLA (as ``zero3_grads.stage3_partition_grads``).
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


def bf16_optimizer_grads_for_clipping(original):
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


def fp16_optimizer_overflow_checker(original):
    """bf16 without ZeRO (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``): leave the per-gradient overflow test to the
    device.

    Upstream reads one flag per gradient (a graph execution each). The step's gradient norm, which
    ``step_guard`` tests on the device, is inf or NaN whenever a gradient is. Patched only in the
    modules binding the two optimizers use; fp16 itself is rejected on XLA (``config_checks``).
    """

    class DeviceCheckedOverflow(original):

        def has_overflow(self, params, has_moe_params=None):
            if params and all(p.grad is None or p.grad.device.type == "xla" for p in params):
                return False
            return super().has_overflow(params, has_moe_params)

    DeviceCheckedOverflow.__qualname__ = DeviceCheckedOverflow.__name__ = original.__name__
    DeviceCheckedOverflow.__wrapped__ = original  # what upstream_digest reads
    return DeviceCheckedOverflow


def get_flattened_grad_norm(original):
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
        total = _sum_of_squared_norms([p.grad for p in params])
        if mpu is not None:
            from deepspeed import comm as dist
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
        return total.sqrt()

    return get_flattened_grad_norm


def get_weight_norm(original):
    """The 2-norm of these tensors as a device tensor; upstream reads each one's norm.

    ``FP16_UnfusedOptimizer`` passes it the gradients. inf and NaN stay as they are where upstream returns its
    -1 sentinel (both are invalid norms). Model parallelism and other norm types take the upstream path.
    """

    @functools.wraps(original)
    def get_weight_norm(parameters, norm_type=2, mpu=None):
        import torch
        from deepspeed.runtime.utils import PIPE_REPLICATED
        given = [parameters] if torch.is_tensor(parameters) else list(parameters)
        tensors = [t for t in given if not (hasattr(t, PIPE_REPLICATED) and t.ds_pipe_replicated)]
        if not tensors or mpu is not None or float(norm_type) != 2.0 or any(t.device.type != "xla" for t in tensors):
            return original(given, norm_type, mpu)
        return _sum_of_squared_norms(tensors).sqrt()

    return get_weight_norm


def _sum_of_squared_norms(tensors):
    """The sum of the tensors' squared 2-norms, in fp32, as one device tensor."""
    import torch
    return torch.stack([t.detach().float().norm(2) for t in tensors]).square().sum()


def get_global_norm(original):
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


def unfused_optimizer_unscale_and_clip_grads(original):
    """``FP16_UnfusedOptimizer``: ``clip = max(clip, 1)`` on the device instead of testing ``clip > 1`` on the host."""

    @functools.wraps(original)
    def unscale_and_clip_grads(self, total_norm, apply_scale=True):
        if not _clips_on_device(self, total_norm):
            return original(self, total_norm, apply_scale)
        combined_scale = _combined_scale(self, total_norm)
        if apply_scale:
            for group in self.fp32_groups:
                for param in group:
                    if param.grad is not None:
                        param.grad.data.mul_(1. / combined_scale)
        return combined_scale

    return unscale_and_clip_grads


def _clips_on_device(optimizer, total_norm) -> bool:
    import torch
    return optimizer.clip_grad > 0. and torch.is_tensor(total_norm) and total_norm.device.type == "xla"


def _combined_scale(optimizer, total_norm):
    """Upstream's loss scale times ``clip`` where ``clip > 1``, as ``max(clip, 1)``: the same values."""
    import torch
    cur_scale = optimizer.loss_scale_config.cur_scale
    return torch.clamp(((total_norm / cur_scale) + 1e-6) / optimizer.clip_grad, min=1.0) * cur_scale


def fp16_optimizer_unscale_and_clip_grads(original):
    """``FP16_Optimizer``: ``clip = max(clip, 1)`` on the device instead of testing ``clip > 1`` on the host."""

    @functools.wraps(original)
    def unscale_and_clip_grads(self, grad_groups_flat, total_norm, apply_scale=True):
        if not _clips_on_device(self, total_norm):
            return original(self, grad_groups_flat, total_norm, apply_scale)
        combined_scale = _combined_scale(self, total_norm)
        if apply_scale:
            for grad in grad_groups_flat:
                grad.data.mul_(1. / combined_scale)
        return combined_scale

    return unscale_and_clip_grads
