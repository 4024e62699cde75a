"""Host buffers that gloo writes collective results into, reused when large.

glibc serves an allocation over 32 MB (its largest mmap threshold) with fresh pages every time, and
faulting them in costs several times the copy into warm memory: a fresh buffer per large all-reduce
held the host-staged all-reduce at about half of gloo's bandwidth (docs/performance.md, "Figures
behind the code"). So large buffers are kept and handed out again once nothing else uses their memory: on
PJRT CPU the XLA tensor that adopted a buffer (``xla_runtime.device_alias``) holds it through DLPack
until torch_xla drops that device buffer, and that shows in the storage's use count.

The cost is memory kept while idle: up to ``PER_SIZE`` buffers for each size over 32 MB a collective
has used (ZeRO's buckets and layer shapes repeat, so there are few such sizes).
"""
import math
from typing import Dict, List, Sequence, Tuple

import torch

POOLED_BYTES = 32 << 20  # smaller allocations come from glibc's heap, whose pages stay mapped
PER_SIZE = 2  # a tensor all-reduced every step alternates between two: the one it holds, the one gloo fills

_POOL: Dict[int, List[Tuple[torch.Tensor, int]]] = {}  # bytes -> (buffer, its storage's use count when idle)


def _uses(buffer: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata)


def _shaped(buffer: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A view of ``buffer``: it holds the storage, so the buffer counts as used while the view lives."""
    return buffer.view(dtype).view(shape)


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized host tensor; above ``POOLED_BYTES`` an idle pooled buffer when there is one. The device is
    named: inside ``deepspeed.zero.Init``, DeepSpeed makes ``torch.empty`` without one allocate on the accelerator."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes <= POOLED_BYTES:
        return torch.empty(shape, dtype=dtype, device="cpu")
    buffers = _POOL.setdefault(nbytes, [])
    for buffer, idle in buffers:
        if _uses(buffer) == idle:
            return _shaped(buffer, shape, dtype)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    if len(buffers) < PER_SIZE:
        buffers.append((buffer, _uses(buffer)))
    return _shaped(buffer, shape, dtype)
