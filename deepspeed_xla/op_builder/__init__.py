"""Op builders for XLA: pure-torch ops that trace into XLA graphs, never JIT-compiled C++/CUDA.

DeepSpeed binds ``get_op_builder(name)`` for every builder name at import, so this never returns
None: names without an XLA implementation get ``NotImplementedBuilder`` (``is_compatible()`` False).
"""
from deepspeed_xla.op_builder.fused_adam import FusedAdamBuilder
from deepspeed_xla.op_builder.fused_lamb import FusedLambBuilder
from deepspeed_xla.op_builder.no_impl import NotImplementedBuilder

_XLA_BUILDERS = {cls.__name__: cls for cls in (FusedAdamBuilder, FusedLambBuilder, NotImplementedBuilder)}
# Host-side ops for ZeRO-Offload, JIT-built with the system C++ compiler like on CUDA.
_HOST_BUILDERS = ("CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder")
# Handled by torch.distributed (our process groups), not by a DeepSpeed native op.
_NO_BUILDER = ("ShareMemCommBuilder", "CCLCommBuilder")


def get_op_builder(class_name: str):
    if class_name in _XLA_BUILDERS:
        return _XLA_BUILDERS[class_name]
    if class_name in _HOST_BUILDERS:
        from deepspeed.ops.op_builder import cpu
        return getattr(cpu, class_name)
    return NotImplementedBuilder


def create_op_builder(class_name: str):
    if class_name in _NO_BUILDER:
        return None
    return get_op_builder(class_name)()
