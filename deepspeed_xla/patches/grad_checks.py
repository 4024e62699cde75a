"""Patches of DeepSpeed's gradient checks and clipping, in every module that binds them.

DeepSpeed imports ``has_inf_or_nan``, ``clip_tensors_by_global_norm`` and ``is_invalid_grad_norm`` by
name, so each importing module's binding is patched. Upstream tests the gradients and the norm on the
host, which on XLA reads a device value every step (and ``has_inf_or_nan`` relies on an ``amax()``
that torch_xla does not reduce); here the tests stay in the graph.
"""
import functools


def has_inf_or_nan(original):
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


def clip_tensors_by_global_norm(original):
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


def is_invalid_grad_norm(original):
    """Leave an XLA norm to the device: ``step_guard`` discards the step's update in the graph instead.

    The host test reads the norm every step (a second graph execution and a device->host transfer).
    ``engine.configure_optimizer`` guards the optimizer steps of the ZeRO and bf16 wrappers, the
    only callers of the patched bindings.
    """

    @functools.wraps(original)
    def is_invalid_grad_norm(norm):
        from deepspeed_xla import step_guard
        return False if step_guard.is_device_checked(norm) else original(norm)

    return is_invalid_grad_norm
