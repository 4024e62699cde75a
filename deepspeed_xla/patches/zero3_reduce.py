"""Patch of ZeRO-3's gradient reduce-scatter (``deepspeed.runtime.comm.coalesced_collectives``): on a host-staged
backend, the graph that computes the gradients also computes everything else still pending.

A host-staged collective (PJRT CPU, ``comm/staging.py``) executes the graph of its operands only. At the end of
ZeRO-3's backward that graph holds the whole forward and backward, yet leaves the loss and the gradients of the
model's inputs pending, so the step's graph computed the forward and the backward a second time (on the test
model of docs/configuration.md's module granularity: a step graph of 2,000 HLO operations where the optimizer's
own take a few hundred). That second copy also made the step's graph depend on how ZeRO-3 gathers the parameters:
a ``stage3_module_granularity_threshold`` that makes the whole model one leaf compiled step graphs of its own.
"""
import functools


def reduce_scatter_computes_pending(original):
    """Before a reduce-scatter of XLA tensors on a host-staged group of several ranks, execute every pending tensor
    in one graph (the one the collective's operands need anyway), so the step's graph is the optimizer's alone.
    Nothing changes where the collective cuts no graph: in-graph collectives (TPU), a one-rank group."""

    @functools.wraps(original)
    def reduce_scatter(input_tensor, output_tensor, group=None, *args, **kwargs):
        if input_tensor.device.type == "xla":
            import torch.distributed as torch_dist

            from deepspeed_xla import xla_runtime
            from deepspeed_xla.comm.host_staged import BACKEND_NAME
            if torch_dist.get_backend(group) == BACKEND_NAME and torch_dist.get_world_size(group) > 1:
                xla_runtime.sync_live()
        return original(input_tensor, output_tensor, group, *args, **kwargs)

    return reduce_scatter
