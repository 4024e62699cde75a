"""FusedLamb for XLA: ``deepspeed.ops.lamb.FusedLamb``'s per-tensor ``lamb`` op in torch ops.

As DeepSpeed's kernel (``csrc/lamb/fused_lamb_cuda_kernel.cu``), the moments enter the update and the
trust ratio uncorrected and the bias corrections scale the step size, ``lr * sqrt(1 - beta2^t) /
(1 - beta1^t)``: corrected moments would change the update's eps and weight-decay shares. The trust
ratio stays a device tensor (``torch.where``, no ``.item()``), so a step is one graph; the per-step
numbers enter it as data (``step_scalars``), so later steps compile nothing new.
"""
import math

import torch

from deepspeed_xla.op_builder.builder import PythonOpBuilder, bias_corrections, step_scalars


class XlaFusedLamb:

    @staticmethod
    def lamb(param, out_param, exp_avg, exp_avg_sq, grad, lr, beta1, beta2, max_coeff, min_coeff, eps,
             grad_scale, step, eps_mode, bias_correction, weight_decay):
        grad = grad.float() / grad_scale
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1, bias2 = bias_corrections(beta1, beta2, step, bias_correction)
        (step_size, ) = step_scalars(param.device, lr * math.sqrt(bias2) / bias1)
        denom = (exp_avg_sq + eps).sqrt() if eps_mode == 0 else exp_avg_sq.sqrt() + eps
        update = exp_avg / denom
        if weight_decay != 0:
            update = update + weight_decay * param.float()
        w_norm = param.float().norm()
        u_norm = update.norm()
        ratio = (w_norm / u_norm).clamp(min_coeff, max_coeff)
        lamb_coeff = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
        param.add_((-step_size * lamb_coeff * update).to(param.dtype))
        if out_param is not None and out_param.numel() > 0:
            out_param.copy_(param)
        return lamb_coeff


class FusedLambBuilder(PythonOpBuilder):
    BUILD_VAR = "DS_BUILD_FUSED_LAMB"
    NAME = "fused_lamb"
    implementation = XlaFusedLamb
