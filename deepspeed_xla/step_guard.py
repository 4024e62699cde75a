"""Skip an optimizer step on the device when the gradient norm is invalid, without reading it.

DeepSpeed's ZeRO and bf16 optimizers test ``is_invalid_grad_norm(norm)`` on the host and skip the
step when the norm is inf, NaN or negative (the sentinel its group-norm helpers use for overflow).
On XLA that test reads the norm back every step: a second graph execution and a device->host
transfer. ``guard_step`` moves the decision onto the device: the optimizer step always runs, and
its results are kept only where the norm is valid (``torch.where``), in the same graph.

What the host no longer sees: a skipped step still counts as a step (global step, LR schedule,
host-side step counters such as FusedAdam's bias-correction step), and state that a skipped first
step creates is zeroed rather than absent. ``on_skip`` receives each step's skip flag, on the device.
"""
import functools
import types
from typing import Callable, Dict, List, Optional, Tuple

import torch

_GUARDED = "_deepspeed_xla_step_guard"


def is_device_checked(norm) -> bool:
    """The norm is an XLA tensor: ``guard_step`` checks it in the graph, the host must not."""
    return torch.is_tensor(norm) and norm.device.type == "xla"


def valid_norm(norm: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's ``not is_invalid_grad_norm(norm)`` as a device boolean."""
    return torch.isfinite(norm).logical_and(norm >= 0).all()


def _stepped_tensors(optimizer: torch.optim.Optimizer) -> List[Tuple[Dict, object]]:
    """``(container, key)`` of every XLA tensor a step of ``optimizer`` may change: parameters and state."""
    slots = []
    for group in optimizer.param_groups:
        for index, param in enumerate(group["params"]):
            if param.grad is None:
                continue
            slots.append((group["params"], index))
            state = optimizer.state.get(param, {})
            slots.extend((state, key) for key, value in state.items()
                         if torch.is_tensor(value) and value.device.type == "xla")
    return slots


def _params_on_device(optimizer: torch.optim.Optimizer) -> bool:
    return all(p.device.type == "xla" for group in optimizer.param_groups for p in group["params"])


def guard_step(optimizer: torch.optim.Optimizer, norm_of: Callable[[], Optional[torch.Tensor]],
               on_skip: Callable[[torch.Tensor], None]) -> None:
    """Make ``optimizer.step`` keep its update only where ``norm_of()`` (read at step time) is valid.

    ``on_skip(invalid)`` receives the device flag of every guarded step. An optimizer whose parameters
    live on the host (ZeRO offload) tests the norm on the host: its step runs there anyway.
    """
    if getattr(optimizer, _GUARDED, False):
        return
    step = optimizer.step
    counted = []  # the norm whose skip was last reported: ZeRO steps once per parameter group with one norm

    def report(valid: torch.Tensor, norm: torch.Tensor) -> None:
        if not (counted and counted[0] is norm):
            counted[:] = [norm]
            on_skip(valid.logical_not())

    def guarded_step(_optimizer, *args, **kwargs):
        norm = norm_of()
        if not is_device_checked(norm):
            return step(*args, **kwargs)
        valid = valid_norm(norm)
        report(valid, norm)
        if not _params_on_device(optimizer):
            return step(*args, **kwargs) if bool(valid.cpu()) else None
        slots = _stepped_tensors(optimizer)
        before = {(id(container), key): container[key].detach().clone() for container, key in slots}
        result = step(*args, **kwargs)
        with torch.no_grad():
            for container, key in _stepped_tensors(optimizer):
                current = container[key]
                old = before.get((id(container), key))
                if old is None or old.shape != current.shape:  # created by this step
                    old = torch.zeros_like(current)
                current.copy_(torch.where(valid, current, old))
        return result

    # A bound method, as ``step`` was: a torch LR scheduler made afterwards (the Trainer's, over DeepSpeed's optimizer)
    # wraps ``optimizer.step`` through its ``__func__``.
    optimizer.step = types.MethodType(functools.wraps(step)(guarded_step), optimizer)
    setattr(optimizer, _GUARDED, True)
