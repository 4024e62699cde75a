"""Reads of device values in the user's training loop after the warm-up steps, named by their line
(docs/troubleshooting.md).

A read (``loss.item()``, ``print(t)``, ``.cpu()``) waits for the device to finish what was queued, so the host cannot
trace the next step meanwhile; one before ``engine.step()`` also cuts the step's graph in two. The user's code runs
between the engine's calls (``forward``, ``backward``, ``step``: ``patches/engine.outside_user_code`` marks them); reads
inside them are DeepSpeed's own (its loss scaler, its progress log every ``steps_per_print`` steps, ZeRO offload) and
never reported. The user's stretches of the first ``WATCHED_STEPS`` steps after the warm-up run under a dispatch mode
that notes the line of each op that moved data to the host (torch_xla's transfer count, read around each op on an
XLA tensor); later stretches only read torch_xla's count of scalar reads (a host counter) and, when it moved, watch
the next step's the same way. Nothing here reads the device or cuts a graph.
"""
import sys
import warnings
from typing import Dict, List, Optional

from deepspeed_xla import compile_watch, xla_runtime

WATCHED_STEPS = 3  # optimizer steps after the warm-up whose user code is watched op by op


def _has_xla_tensor(values) -> bool:
    import torch
    from torch.utils._pytree import tree_leaves
    return any(isinstance(value, torch.Tensor) and value.device.type == "xla" for value in tree_leaves(values))


def _mode_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class ReadsMode(TorchDispatchMode):
        """Notes the line of each op on an XLA tensor that transferred data to the host."""

        def __init__(self):
            super().__init__()
            self.reads = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not _has_xla_tensor((args, kwargs)):
                return func(*args, **kwargs)
            before = xla_runtime.transfers_to_host()
            result = func(*args, **kwargs)
            if xla_runtime.transfers_to_host() != before:
                self.reads.append((func.__name__.split(".")[0], compile_watch.stack_frames(sys._getframe(1))))
            return result

    return ReadsMode


class Reads:
    """This process's watch of the user's code between the engine's calls (see the module docstring)."""

    def __init__(self, config: compile_watch.Settings, rank: int):
        self.config, self.rank = config, rank
        self.depth = 0  # engine calls in progress (forward calls step's hooks, the pipeline engine nests)
        self.repeats = compile_watch.Repeats()
        self._mode = None  # the dispatch mode of a watched stretch, while it runs
        self._scalars: Optional[int] = None  # torch_xla's scalar reads when the stretch began
        self._watch_step: Optional[int] = None  # a later step to watch: its scalar reads moved one step before
        self._framework, self._engine = (), ()  # compile_watch's framework_dirs and engine_dirs, once needed

    def stretch_begins(self, step: int) -> None:
        """The engine returned to the user's code after ``step`` optimizer steps."""
        if step < self.config.warmup:
            return
        if step < self.config.warmup + WATCHED_STEPS or step == self._watch_step:
            if not self._framework:
                self._framework, self._engine = compile_watch.framework_dirs(), compile_watch.engine_dirs()
            self._mode = _mode_class()()
            self._mode.__enter__()
        else:
            self._scalars = xla_runtime.scalar_reads()

    def stretch_ends(self, step: int) -> None:
        """The user's code calls the engine again (``step`` optimizer steps done)."""
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
            self._report(step, mode.reads)
        elif self._scalars is not None:
            if xla_runtime.scalar_reads() != self._scalars and self._still_warning():
                self._watch_step = step + 1
        self._scalars = None

    def _still_warning(self) -> bool:
        return not self.repeats.counts or min(self.repeats.counts.values()) < compile_watch.REPEATS

    def _report(self, step: int, reads: List[tuple]) -> None:
        lines: Dict[compile_watch.Frame, List[str]] = {}
        for op, frames in reads:
            innermost = next((frame for frame in frames if not frame.file.startswith(self._framework)), None)
            if innermost is None or innermost.file.startswith(self._engine):
                continue  # DeepSpeed's or deepspeed_xla's own read (called from the user's line, or a hook)
            lines.setdefault(innermost, []).append(op)
        for frame, ops in lines.items():
            tail = self.repeats.note(("read", frame))
            if tail is None:
                continue
            warnings.warn(
                f"deepspeed_xla: rank {self.rank} read a device value on the host at {compile_watch.where(frame)} "
                f"({len(ops)} transfer(s): {', '.join(sorted(set(ops)))}) between optimizer steps {step} and "
                f"{step + 1}, after the {self.config.warmup} warm-up steps ({compile_watch.WARMUP_ENV}): each read waits for the device "
                "to finish the work queued so far, so the host cannot trace the next step meanwhile, and a read "
                "before engine.step() cuts the step's graph in two. Keep the value on the device and read it every N "
                f"steps (sum the losses into a tensor, read it when you log).{tail}", RuntimeWarning, stacklevel=2)


_reads: Optional[Reads] = None


def reads(rank: int) -> Optional[Reads]:
    """This process's ``Reads`` (None with ``DS_XLA_STEP_WARNINGS=0``)."""
    global _reads
    if _reads is None:
        config = compile_watch.settings()
        if not config.enabled:
            return None
        _reads = Reads(config, rank)
    return _reads


class EngineCall:
    """Marks a call of the engine (its code, not the user's) for ``Reads``; one per call, cheap when nested."""
    __slots__ = ("engine", "reads")

    def __init__(self, engine):
        self.engine, self.reads = engine, reads(engine.global_rank)

    def __enter__(self) -> None:
        if self.reads is not None:
            if self.reads.depth == 0:
                self.reads.stretch_ends(self.engine.global_steps)
            self.reads.depth += 1

    def __exit__(self, *exc) -> None:
        if self.reads is not None:
            self.reads.depth -= 1
            if self.reads.depth == 0:
                self.reads.stretch_begins(self.engine.global_steps)
