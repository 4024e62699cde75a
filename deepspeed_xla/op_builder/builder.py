"""Base for builders whose ``load()`` returns a Python object instead of a compiled extension."""
import functools
from typing import Tuple

import torch
from deepspeed.ops.op_builder.builder import OpBuilder


def step_scalars(device: torch.device, *values: float) -> Tuple[torch.Tensor, ...]:
    """An optimizer's per-step numbers (learning rate, bias corrections) as 0-d float32 tensors on ``device``.

    torch_xla bakes the Python scalars 0 and 1 into the graph as constants, other values enter as
    data. Passed as numbers, a bias correction reaching exactly 1.0 (step ~370 with beta1 0.9, ~37k
    with beta2 0.999) or a learning rate scheduled from or to 0 would each compile a new graph.
    """
    return _on_device(device, values).unbind()


def bias_corrections(beta1: float, beta2: float, step: int, enabled: bool) -> Tuple[float, float]:
    """Adam's ``1 - beta**step`` for both moments (1.0 each when bias correction is off), as host numbers."""
    return (1 - beta1**step, 1 - beta2**step) if enabled else (1.0, 1.0)


@functools.lru_cache(maxsize=8)
def _on_device(device: torch.device, values: Tuple[float, ...]) -> torch.Tensor:
    """One host->device copy per step for an op called once per tensor (FusedLamb). The cached tensor
    is device data that nothing writes; its 0-d views are made per call, since a view that outlives a
    sync becomes device data itself and the next graph that reads it would differ."""
    return torch.tensor(values, dtype=torch.float32, device=device)


class PythonOpBuilder(OpBuilder):
    """An op implemented in torch: always compatible, nothing to compile, nothing to cache."""

    #: Set by subclasses: the object ``load()`` returns (DeepSpeed calls its methods as the op).
    implementation = None

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return f"deepspeed_xla.op_builder.{self.NAME}_op"

    def sources(self):
        return []

    def include_paths(self):
        return []

    def is_compatible(self, verbose=False):
        return True

    def load(self, verbose=True):
        return self.implementation
