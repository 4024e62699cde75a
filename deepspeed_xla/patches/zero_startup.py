"""Patches of what DeepSpeed does once per parameter while ``deepspeed.initialize`` builds the engine and ZeRO.

XLA compiles a graph for every distinct computation it executes. ZeRO-3 moves its parameter partitions into one
flat buffer through host memory one tensor at a time: each partition is still the pending copy out of its parameter,
so every one is a graph execution (and a compilation per distinct partition shape) before the first step, a number
that grows with the model's tensors. Here the same move is one execution and one transfer. The engine (and ZeRO-3
again when it partitions) broadcasts every parameter as a ``uint8`` view, which torch_xla makes by copying the
parameter to host memory and back (``aten::view_copy.dtype``); here the same bytes go in the parameter's own dtype.
"""
import functools

#: Dtypes every backend broadcasts as they are; others (fp8, ...) keep upstream's byte view.
_PLAIN_DTYPES = ("float32", "bfloat16", "float16")


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


def _broadcast_bytes(tensor, src: int, group) -> None:
    """``dist.broadcast`` of ``tensor``'s bytes, without a byte view where its dtype needs none (a copy, bit for
    bit, either way)."""
    import torch
    from deepspeed import comm as dist
    plain = tensor.device.type == "xla" and str(tensor.dtype).removeprefix("torch.") in _PLAIN_DTYPES
    dist.broadcast(tensor if plain else tensor.view(torch.uint8), src, group=group)


def broadcast_model_in_place(original):
    """``DeepSpeedEngine._broadcast_model``: each replicated parameter from the group's first rank, as upstream, in its
    own dtype (``_broadcast_bytes``) instead of a host round trip of the whole model."""

    @functools.wraps(original)
    def broadcast_model(self):
        if self.dist_backend is None:
            return
        from deepspeed.moe.utils import is_moe_param
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.utils import groups
        for _, param in self.module.named_parameters():
            if getattr(param, "ds_status", ZeroParamStatus.AVAILABLE) is not ZeroParamStatus.AVAILABLE or hasattr(
                    param, "ds_optim_param"):
                continue  # partitioned, or an OptimizedLinear shard: not replicated
            if is_moe_param(param):
                _broadcast_bytes(param.data, groups._get_expert_broadcast_src_rank(param.group_name),
                                 self.expert_data_parallel_group[param.group_name])
            else:
                _broadcast_bytes(param.data, groups._get_broadcast_src_rank(), self.seq_data_parallel_group)

    return broadcast_model


def zero_init_param_in_place(original):
    """``zero.Init._zero_init_param`` (ZeRO-3 converting a model built outside ``zero.Init``): the parameter from its
    partition group's first rank in its own dtype (``_broadcast_bytes``), then partitioned, as upstream."""

    @functools.wraps(original)
    def zero_init_param(self, param):
        from deepspeed import comm as dist
        self._convert_to_deepspeed_param(param)
        group = self.get_partition_dp_group(param)
        src = 0 if dist.get_world_group() == group else dist.get_global_rank(group, 0)
        _broadcast_bytes(param.data, src, group)
        param.partition()

    return zero_init_param
