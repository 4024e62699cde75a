"""Patches of what DeepSpeed's ZeRO does once per parameter while ``deepspeed.initialize`` builds it.

XLA compiles a graph for every distinct computation it executes. ZeRO-3 moves its parameter partitions into one
flat buffer through host memory one tensor at a time: each partition is still the pending copy out of its parameter,
so every one is a graph execution (and a compilation per distinct partition shape) before the first step, a number
that grows with the model's tensors. Here the same move is one execution and one transfer.
"""
import functools


def defragment_at_once(original):
    """ZeRO-3's ``defragment`` (imported by name into ``stage3``): the partitions reach host memory in one execution.

    Upstream copies each device tensor into its span of a host buffer, which on XLA executes the pending copy of each
    partition as a graph of its own, then uploads the buffer and points each tensor at its span. Here every partition
    is materialized and read in one execution and one transfer, then uploaded once as upstream does; the device holds
    no more than upstream's partitions meanwhile (the host buffer is built from the host copies).
    """

    @functools.wraps(original)
    def defragment(tensors):
        if not tensors or tensors[0].device.type != "xla":
            return original(tensors)
        import torch
        from deepspeed_xla import xla_runtime
        assert len({t.dtype for t in tensors}) == 1 and len({t.device for t in tensors}) == 1
        device = tensors[0].device
        numels = [tensor.numel() for tensor in tensors]
        host = xla_runtime.to_host(list(tensors))
        cpu_buffer = torch.cat([values.reshape(-1) for values in host])
        del host
        for tensor in tensors:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=device)
        device_buffer = cpu_buffer.to(device)
        for tensor, piece in zip(tensors, device_buffer.split(numels)):
            tensor.data = piece
        return device_buffer

    return defragment
