"""Patches for DeepSpeed's AutoTP layers (``deepspeed.module_inject.layers``) on XLA.

AutoTP shards the model inside ``deepspeed.initialize`` before the engine moves it to the device: each layer
moves its shard to the accelerator and assigns it to the host Parameter's ``.data``, which torch refuses for an
XLA tensor ("incompatible tensor type"). The engine moves every parameter to the device right afterwards.
"""
import functools


def keeps_host_shards_on_host(original):
    """``TensorParallel_Layer.move``: a host tensor's shard stays on the host, as a copy (the full weight it was
    split from is freed, as upstream frees it); the engine's move takes it to the device with the rest."""

    @functools.wraps(original)
    def move(self, tensor):
        if tensor.device.type != "cpu":
            return original(self, tensor)
        shard = tensor.to("cpu", copy=True)
        tensor.data = tensor.new_empty(0)
        return shard

    return move
