"""Skip an optimizer step on the device when the gradient norm is invalid, without reading it.

DeepSpeed's ZeRO and bf16 optimizers test ``is_invalid_grad_norm(norm)`` on the host and skip the
step when the norm is inf, NaN or negative (the sentinel its group-norm helpers use for overflow).
On XLA that test reads the norm back every step: a second graph execution and a device->host
transfer. ``guard_step`` moves the decision onto the device: the optimizer step always runs, and
its results are kept only where the norm is valid (``torch.where``), in the same graph.

What the host no longer sees: a skipped step still counts as a step (global step, LR schedule,
host-side step counters such as FusedAdam's bias-correction step), and state that a skipped first
step creates is zeroed rather than absent. ``on_skip`` receives each step's skip flag, on the device.

``SkipCounter`` counts the skipped steps on the device, and the streaks of consecutive ones: DeepSpeed reads the norm
every step (its loss scaler logs each skip), and here nothing reads it until something reads the count.
"""
import functools
import os
import types
import warnings
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch

from deepspeed_xla import env_vars

_GUARDED = "_deepspeed_xla_step_guard"
STREAK_ENV = "DS_XLA_SKIP_STREAK"
DEFAULT_STREAK = 3


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


class SkipCounter:
    """Skipped steps counted on the device, and a warning for each streak of ``DS_XLA_SKIP_STREAK`` (default 3) or
    more in a row, given when the count is read: DeepSpeed's progress log every ``steps_per_print`` steps, a
    checkpoint save, the user's ``engine.skipped_steps``. Counting reads nothing: a step stays one graph without a
    host read.

    The device holds, in one tensor read with one transfer: skipped steps in all, the current run of skipped steps,
    how many runs reached the threshold, the length of the latest such run and the steps since it ended. The host
    keeps the number of the latest step, so the warning can name the steps.
    """

    _TOTAL, _RUN, _STREAKS, _LENGTH, _SINCE = range(5)

    def __init__(self, env: Mapping[str, str] = os.environ):
        self.threshold = env_vars.positive_int(env, STREAK_ENV) or DEFAULT_STREAK
        self._state: Optional[torch.Tensor] = None
        self._step = 0  # the number of the latest counted step
        self._warned = 0  # streaks warned about

    def add(self, skipped: torch.Tensor, step: int) -> None:
        """Count step number ``step``, skipped where the device flag ``skipped`` is true."""
        state = torch.zeros(5, dtype=torch.long, device=skipped.device) if self._state is None else self._state
        skipped = skipped.long()
        run = (state[self._RUN] + 1) * skipped
        long_run = run >= self.threshold
        self._state = torch.stack([
            state[self._TOTAL] + skipped, run, state[self._STREAKS] + (run == self.threshold).long(),
            torch.where(long_run, run, state[self._LENGTH]),
            torch.where(long_run, torch.zeros_like(run), state[self._SINCE] + 1)])
        self._step = step

    def read(self) -> int:
        """The number of skipped steps, warning of the streaks not warned about yet."""
        if self._state is None:
            return 0
        total, _, streaks, length, since = self._state.cpu().tolist()
        if streaks > self._warned:
            self._warn(streaks - self._warned, length, self._step - since, ongoing=since == 0)
            self._warned = streaks
        return total

    def _warn(self, new: int, length: int, last: int, ongoing: bool) -> None:
        latest = f"{new} runs of {self.threshold} or more skipped steps, the latest: " if new > 1 else ""
        still = ", and still skipping" if ongoing else ""
        warnings.warn(
            f"deepspeed_xla: {latest}{length} optimizer steps in a row were skipped (steps {last - length + 1}-{last}"
            f"{still}): their gradient norm was inf or NaN, so the weights did not change. No loss scale adjusts to "
            f"this in bf16 or fp32: look for inf or NaN in the data of those steps, lower the learning rate (or warm "
            f"it up longer), or set gradient_clipping. {STREAK_ENV}={self.threshold} is how many skipped steps in a "
            f"row this warns of.", RuntimeWarning, stacklevel=2)
