"""Reads of device values in the user's training loop after the warm-up steps, named by their line
(docs/troubleshooting.md).

A read (``loss.item()``, ``print(t)``, ``.cpu()``) waits for the device to finish what was queued, so the host cannot
trace the next step meanwhile; one before ``engine.step()`` also cuts the step's graph in two. The user's code runs
between the engine's calls (``forward``, ``backward``, ``step``: ``patches/engine.outside_user_code`` marks them); reads
inside them are DeepSpeed's own (its loss scaler, its progress log every ``steps_per_print`` steps, ZeRO offload) and
never reported. The user's stretches of the first ``WATCHED_STEPS`` steps after the warm-up run under a profile
function that notes the line of each call that moved data to the host (``_Profile``: torch_xla's counts, read
around each C method of an XLA tensor); later stretches only read torch_xla's count of scalar reads (a host
counter), and a stretch that read has the next step's watched the same way. A line is warned of when it reads in
two steps running: a loss read when it is logged every N steps is not the every-step wait this is about. Nothing
here reads the device, cuts a graph or changes what is traced.
"""
import os
import sys
from typing import Dict, List, Optional

from deepspeed_xla import compile_watch, xla_runtime

WATCHED_STEPS = 3  # optimizer steps after the warm-up whose user code is watched call by call


class _Profile:
    """The profile function (``sys.setprofile``) of a watched stretch: notes where the device was read. A C method
    of an XLA tensor (``.item()``, ``.cpu()``, ``.tolist()``, within ``print`` too) that moved torch_xla's transfer
    count is named; a scalar read through a slot (``float(t)``, ``if t:``), which calls nothing Python sees, is seen
    by its counter at the next event and named at the line of the event before it.
    Tracing is untouched: the same ops reach torch_xla (a dispatch mode would trace some of them anew)."""

    def __init__(self):
        import torch
        self._tensor = torch.Tensor
        self.reads: List[tuple] = []
        self._scalars = xla_runtime.scalar_reads()
        # Only plain values are kept from one event to the next: a frame or a bound method kept would keep tensors
        # alive, and a sync in the stretch (a host-staged collective) would then compute them too: another graph.
        self._pending: Optional[tuple] = None  # (id of the C method of an XLA tensor being called, transfers before)
        self._last: Optional[tuple] = None  # (code, Frame) of the last event: where a slot's scalar read is named

    def _on_xla_tensor(self, function) -> bool:
        owner = getattr(function, "__self__", None)
        return isinstance(owner, self._tensor) and owner.device.type == "xla"

    def __call__(self, frame, event: str, arg) -> None:
        pending, self._pending = self._pending, None
        if event == "c_return" and pending is not None and pending[0] == id(arg):
            if xla_runtime.transfers_to_host() != pending[1]:
                self.reads.append((arg.__name__, compile_watch.stack_frames(frame)))
            self._scalars = xla_runtime.scalar_reads()  # the method's own scalar read, named if it transferred
        elif xla_runtime.scalar_reads() != self._scalars:  # since the last event: named at that event's line
            frames = compile_watch.stack_frames(frame)
            if self._last is not None and self._last[0] is frame.f_code:
                frames = (self._last[1], *frames[1:])
            self.reads.append(("a scalar read", frames))
            self._scalars = xla_runtime.scalar_reads()
        if event == "c_call" and self._on_xla_tensor(arg):
            self._pending = (id(arg), xla_runtime.transfers_to_host())
        code = frame.f_code
        self._last = (code, compile_watch.Frame(code.co_name, code.co_filename, frame.f_lineno))


def _not_in_children() -> None:
    """A process forked while the user's code is watched (a DataLoader's worker) does not watch itself."""
    if isinstance(sys.getprofile(), _Profile):
        sys.setprofile(None)


os.register_at_fork(after_in_child=_not_in_children)


class Reads:
    """This process's watch of the user's code between the engine's calls (see the module docstring)."""

    def __init__(self, config: compile_watch.Settings, rank: int):
        self.config, self.rank = config, rank
        self.depth = 0  # engine calls in progress (forward calls step's hooks, the pipeline engine nests)
        self.repeats = compile_watch.Repeats()
        self._profile: Optional[_Profile] = None  # the profile function of a watched stretch, while it runs
        self._scalars: Optional[int] = None  # torch_xla's scalar reads when the stretch began
        self._watch_step: Optional[int] = None  # the next step to watch: this one read
        self._read_at: Dict[object, int] = {}  # the last step each line read in (None: a counted, unnamed read)
        self._framework, self._engine = (), ()  # compile_watch's framework_dirs and engine_dirs, once needed

    def stretch_begins(self, step: int) -> None:
        """The engine returned to the user's code after ``step`` optimizer steps."""
        if step < self.config.warmup:
            return
        if (step < self.config.warmup + WATCHED_STEPS or step == self._watch_step) and sys.getprofile() is None:
            if not self._framework:
                self._framework, self._engine = compile_watch.framework_dirs(), compile_watch.engine_dirs()
            self._profile = _Profile()
            sys.setprofile(self._profile)
        else:
            self._scalars = xla_runtime.scalar_reads()

    def stretch_ends(self, step: int) -> None:
        """The user's code calls the engine again (``step`` optimizer steps done)."""
        profile, self._profile = self._profile, None
        if profile is not None:
            sys.setprofile(None)
            if self._report(step, profile.reads) and self._still_warning():
                self._watch_step = step + 1
        elif self._scalars is not None:
            if xla_runtime.scalar_reads() != self._scalars and self._still_warning():
                self._read_at[None], self._watch_step = step, step + 1
        self._scalars = None

    def _still_warning(self) -> bool:
        return not self.repeats.counts or min(self.repeats.counts.values()) < compile_watch.REPEATS

    def _report(self, step: int, reads: List[tuple]) -> bool:
        """Warn of each line that read in this step and in the one before; whether the user's code read."""
        lines: Dict[compile_watch.Frame, List[str]] = {}
        for op, frames in reads:
            innermost = next((frame for frame in frames if not frame.file.startswith(self._framework)), None)
            if innermost is None or innermost.file.startswith(self._engine):
                continue  # DeepSpeed's or deepspeed_xla's own read (called from the user's line, or a hook)
            lines.setdefault(innermost, []).append(op)
        for frame, ops in lines.items():
            running = step - 1 in (self._read_at.get(frame), self._read_at.get(None))
            self._read_at[frame] = step
            if not running:
                continue
            tail = self.repeats.note(("read", frame))
            if tail is None:
                continue
            compile_watch.warn_at(
                f"deepspeed_xla: rank {self.rank} read a device value on the host at {compile_watch.where(frame)} "
                f"({len(ops)} transfer(s): {', '.join(sorted(set(ops)))}) between optimizer steps {step} and "
                f"{step + 1}, after the {self.config.warmup} warm-up steps ({compile_watch.WARMUP_ENV}): each read "
                "waits for the device to finish the work queued so far, so the host cannot trace the next step "
                "meanwhile, and a read before engine.step() cuts the step's graph in two. Keep the value on the device "
                f"and read it every N steps (sum the losses into a tensor, read it when you log).{tail}", frame)
        return bool(lines)


_reads: Optional[Reads] = None


def reads(rank: int) -> Optional[Reads]:
    """This process's ``Reads`` (None with ``DS_XLA_STEP_WARNINGS=0``)."""
    global _reads
    if _reads is None:
        config = compile_watch.process_settings()
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
