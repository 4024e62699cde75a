"""FusedAdam for XLA: DeepSpeed's ``multi_tensor_adam`` contract in ``torch._foreach_*`` ops.

``deepspeed.ops.adam.FusedAdam`` (the default for ``"type": "Adam"/"AdamW"``) calls
``multi_tensor_applier(op.multi_tensor_adam, noop_flag, [g, p, m, v], lr, beta1, beta2, eps, step,
adam_w_mode, bias_correction, weight_decay)``. The per-step numbers enter the graph as data
(``step_scalars``), so later steps compile nothing new.

Tracing, not the device, bounds a small model's step, so the update is built from out-of-place
foreach ops and written back with one copy per list: torch_xla traces an in-place foreach op several
times slower than an out-of-place one, and ``addcmul_`` slower still (docs/performance.md, "Figures
behind the code"). The bias correction of the first moment and the decoupled weight decay are folded into
scalars, as ``torch.optim.AdamW`` does (``p·(1 − lr·wd) − lr/(1 − β₁ᵗ)·m/denom``): two operations per
element fewer than the CUDA kernel's ``p − lr·(m̂/denom + wd·p)``, the same update up to rounding.
"""
import math

import torch

from deepspeed_xla.op_builder.builder import PythonOpBuilder, bias_corrections, step_scalars


class XlaFusedAdam:

    @staticmethod
    def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, adam_w_mode,
                          bias_correction, weight_decay, *args):
        grads, params, exp_avgs, exp_avg_sqs = tensor_lists
        if not params:
            return
        bias1, bias2 = bias_corrections(beta1, beta2, step, bias_correction)
        decoupled = weight_decay != 0 and adam_w_mode
        step_size, bias2_sqrt, decay = step_scalars(params[0].device, lr / bias1, math.sqrt(bias2),
                                                    1 - lr * weight_decay if decoupled else 1.0)
        if weight_decay != 0 and not adam_w_mode:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
        avgs = torch._foreach_add(torch._foreach_mul(exp_avgs, beta1), torch._foreach_mul(grads, 1 - beta1))
        squares = torch._foreach_mul(torch._foreach_mul(grads, grads), 1 - beta2)
        avg_sqs = torch._foreach_add(torch._foreach_mul(exp_avg_sqs, beta2), squares)
        denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(avg_sqs), bias2_sqrt), eps)
        updates = torch._foreach_mul(torch._foreach_div(avgs, denom), step_size)
        stepped = torch._foreach_sub(torch._foreach_mul(params, decay) if decoupled else params, updates)
        for old, new in ((exp_avgs, avgs), (exp_avg_sqs, avg_sqs), (params, stepped)):
            torch._foreach_copy_(old, new)


class FusedAdamBuilder(PythonOpBuilder):
    BUILD_VAR = "DS_BUILD_FUSED_ADAM"
    NAME = "fused_adam"
    implementation = XlaFusedAdam
