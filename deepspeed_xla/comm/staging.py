"""Staging a collective's XLA operands in host memory, and writing its results back to the device.

Where device buffers are host memory (PJRT CPU), nothing crosses a device boundary: gloo reads the XLA
buffers through DLPack, and each result reaches its XLA tensor as a copy from an XLA alias of gloo's
buffer inside the next graph (for a whole tensor, torch_xla just adopts the buffer). An in-place
operand is copied once on the host first, since XLA buffers must not change; large buffers are reused
(``host_buffers``). Elsewhere (the TPU side channel) the operands are copied to host memory and back.
Which of the two applies is told once, when the backend is registered (``backends.register_backend``).
"""
from typing import List, Sequence

import torch

from deepspeed_xla import xla_runtime
from deepspeed_xla.comm import host_buffers

_zero_copy = False


def configure(zero_copy: bool) -> None:
    """``zero_copy``: device buffers are host memory that gloo can read and fill in place (PJRT CPU)."""
    global _zero_copy
    _zero_copy = zero_copy


def zero_copy() -> bool:
    return _zero_copy


def is_xla(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "xla"


def to_host(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Host tensors for ``tensors``: CPU ones as they are, XLA ones with one execution, then views or copies."""
    xla = [t for t in tensors if is_xla(t)]
    if not xla:
        return list(tensors)
    hosts = iter(xla_runtime.host_views(xla) if zero_copy() else xla_runtime.to_host(xla))
    return [next(hosts) if is_xla(t) else t for t in tensors]


def host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """Where gloo writes a pure output: host memory of its own, so the device data is never read."""
    return host_buffers.empty(tensor.shape, tensor.dtype) if is_xla(tensor) else tensor


def writable(staged: torch.Tensor) -> torch.Tensor:
    """An in-place operand's host buffer: a view of an XLA buffer is read-only, gloo writes a copy."""
    return host_buffers.empty(staged.shape, staged.dtype).copy_(staged) if zero_copy() else staged


def write_back(targets: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor]) -> None:
    """Like a backend writing device memory: no autograd (targets may be parameters, e.g. tied weights).

    Zero-copy, the source is an XLA alias of the host buffer: the copy joins the next graph (and reaches
    the target's views and base like any in-place op) instead of being a host-to-device transfer.
    """
    with torch.no_grad():
        for target, host in zip(targets, hosts):
            if target is not host:
                target.copy_(xla_runtime.device_alias(host) if zero_copy() and is_xla(target) else host)


def copy_local(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    """Any collective of a one-rank group: each output is its input (in place, or a copy in the output's shape)."""
    assert len(inputs) == len(outputs), "a one-rank collective pairs each input with one output"
    with torch.no_grad():
        for target, source in zip(outputs, inputs):
            if target is not source:
                target.copy_(source.reshape(target.shape))
