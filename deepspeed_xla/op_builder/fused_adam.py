"""FusedAdam for XLA: DeepSpeed's ``multi_tensor_adam`` contract in ``torch._foreach_*`` ops.

``deepspeed.ops.adam.FusedAdam`` (the default for ``"type": "Adam"/"AdamW"``) calls
``multi_tensor_applier(op.multi_tensor_adam, noop_flag, [g, p, m, v], lr, beta1, beta2, eps, step,
adam_w_mode, bias_correction, weight_decay)``. Scalars stay Python numbers: torch_xla passes them
as graph parameters, so a changing step count does not recompile.
"""
import math

import torch

from deepspeed_xla.op_builder.builder import PythonOpBuilder


class XlaFusedAdam:

    @staticmethod
    def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, adam_w_mode,
                          bias_correction, weight_decay, *args):
        grads, params, exp_avgs, exp_avg_sqs = tensor_lists
        if not params:
            return
        if weight_decay != 0 and not adam_w_mode:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        bias1 = 1 - beta1**step if bias_correction else 1.0
        bias2 = 1 - beta2**step if bias_correction else 1.0
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, math.sqrt(bias2))
        torch._foreach_add_(denom, eps)
        updates = torch._foreach_div(exp_avgs, denom)
        torch._foreach_div_(updates, bias1)
        if weight_decay != 0 and adam_w_mode:
            torch._foreach_add_(updates, params, alpha=weight_decay)
        torch._foreach_add_(params, updates, alpha=-lr)


class FusedAdamBuilder(PythonOpBuilder):
    BUILD_VAR = "DS_BUILD_FUSED_ADAM"
    NAME = "fused_adam"
    implementation = XlaFusedAdam
