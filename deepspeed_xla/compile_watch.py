"""What XLA's compiler does during training, told to the user unasked (docs/troubleshooting.md).

Two things at the end of each step's graph (``patches/engine.sync_after``), where deepspeed_xla cuts it:
- a compilation longer than ``DS_XLA_COMPILE_NOTICE_SECONDS`` is announced on rank 0 while it runs, and its time
  given when it ends, on one line (``compiling the step graph (first step)... 41 s``), so that a first step that
  compiles for minutes is not taken for a hang; the watchdog reports such a rank as compiling (``compiling``);
- after the ``DS_XLA_WARMUP_STEPS`` warm-up steps, a step that compiled a graph XLA had not seen warns on the rank
  that compiled it, with the cause and the user's line from torch_xla's own compilation analysis
  (``PT_XLA_DEBUG_LEVEL=1``, asked for in a file of each process's own: ``enable_analysis``), a few times per line.

torch_xla analyses compilations on each host's first process only (``PJRT_LOCAL_PROCESS_RANK`` 0); on the others
a compilation at the step's end is named from the Python stack of the sync that compiled it, the frames torch_xla
records. Counting adds two host counter reads per step: no device read, no graph cut.
"""
import atexit
import functools
import os
import re
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import warnings
from typing import Dict, List, Mapping, MutableMapping, NamedTuple, Optional, Sequence, Tuple

from deepspeed_xla import env_vars, xla_runtime

SWITCH_ENV = "DS_XLA_STEP_WARNINGS"
WARMUP_ENV = "DS_XLA_WARMUP_STEPS"
NOTICE_ENV = "DS_XLA_COMPILE_NOTICE_SECONDS"
DEFAULT_WARMUP = 5  # DeepSpeed's first steps compile a graph each (optimizer state appears, the loss scale settles)
DEFAULT_NOTICE_SECONDS = 10.0
REPEATS = 3  # warnings per cause and line; the last one says it is the last
#: What the user may have set to see torch_xla's analysis where they want it: then it is theirs, not read here.
_USER_ANALYSIS = ("PT_XLA_DEBUG", "PT_XLA_DEBUG_LEVEL", "PT_XLA_DEBUG_FILE")
_PREFIX = "Compilation Analysis: "
_FILE_PREFIX = "deepspeed_xla-compilations-"  # then the writing process's id, so that an orphan can be told
_ORPHAN = re.compile(re.escape(_FILE_PREFIX) + r"(\d+)-\w+\.txt")
_FRAME = re.compile(r"^\s+(.*) \((.+):(\d+)\)$")
_THIS_FILE = os.path.join("deepspeed_xla", "compile_watch.py")  # graph_end's, in a frame: the step's end


class Settings(NamedTuple):
    enabled: bool
    warmup: int
    notice_seconds: float


@functools.lru_cache(maxsize=None)
def process_settings() -> Settings:
    """``settings()`` of this process, read once: ``watch`` and ``host_reads.reads`` ask at every engine call and
    step, and with the warnings off nothing else keeps the answer."""
    return settings()


def settings(env: Mapping[str, str] = os.environ) -> Settings:
    """The user's settings, each refused with the fix when malformed."""
    notice = env_vars.number(env, NOTICE_ENV, "a number of seconds such as 10")
    if notice is not None and notice < 0:
        raise ValueError(f"{NOTICE_ENV}={env[NOTICE_ENV]!r} is negative: set it to a number of seconds such as 10 "
                         "(0 announces every compilation of a step graph), or unset it.")
    warmup = env.get(WARMUP_ENV, "").strip()
    if warmup and not warmup.isdigit():
        raise ValueError(f"{WARMUP_ENV}={warmup!r} is not a count of steps: set it to a count such as 5 (0 warns "
                         "from the first step), or unset it.")
    enabled = env_vars.flag(env, SWITCH_ENV)
    return Settings(enabled is not False, int(warmup) if warmup else DEFAULT_WARMUP,
                    DEFAULT_NOTICE_SECONDS if notice is None else notice)


def enable_analysis(env: MutableMapping[str, str]) -> None:
    """Ask torch_xla for its compilation analysis in a file of this process's own, before its first compilation
    (torch_xla reads the settings once). Only where torch_xla writes it (a host's first process), and not when the
    user asked for it themselves (it then goes where they said) or turned the warnings off."""
    if (not settings(env).enabled or any(name in env for name in _USER_ANALYSIS)
            or env.get("PJRT_LOCAL_PROCESS_RANK", "0") != "0"):
        return
    _remove_orphans(tempfile.gettempdir())
    handle, path = tempfile.mkstemp(prefix=f"{_FILE_PREFIX}{os.getpid()}-", suffix=".txt")
    os.close(handle)
    atexit.register(_remove, path, os.getpid())
    env.update(PT_XLA_DEBUG_LEVEL="1", PT_XLA_DEBUG_FILE=path, PT_XLA_DEBUG_MAX_FRAME="64")


def _remove_orphans(folder: str) -> None:
    """Remove the analysis files of this user's processes that ended without their exit handlers (killed, or
    ``os._exit``: a launcher tearing a job down), which would otherwise stay in the temporary folder for ever."""
    for name in os.listdir(folder):
        match = _ORPHAN.fullmatch(name)
        if match and not _alive(int(match.group(1))):
            _remove(os.path.join(folder, name), os.getpid())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process, alive
        pass
    return True


def _remove(path: str, pid: int) -> None:
    if os.getpid() == pid:  # not a forked child's exit
        try:
            os.remove(path)
        except OSError:
            pass


def _analysis_level(env: Mapping[str, str]) -> int:
    """torch_xla's debug level as it reads it (``PT_XLA_DEBUG=1`` alone is 100): 1 and above analyse compilations."""
    level = env.get("PT_XLA_DEBUG_LEVEL", "").strip()
    if level.lstrip("-").isdigit():
        return int(level)
    return 100 if env.get("PT_XLA_DEBUG", "0").strip() not in ("", "0") else 0


class Frame(NamedTuple):
    function: str
    file: str
    line: int


class Compilation(NamedTuple):
    """One block of torch_xla's compilation analysis: its cause, the graph's hash, the Python frames (innermost
    first)."""
    cause: str
    graph: str
    frames: Tuple[Frame, ...]

    @property
    def at_step_end(self) -> bool:
        return any(frame.function == "graph_end" and frame.file.endswith(_THIS_FILE) for frame in self.frames)


def parse_analysis(text: str) -> List[Compilation]:
    """The complete "Compilation Analysis" blocks of torch_xla's debug output (the other lines are skipped)."""
    blocks, section, current = [], None, None
    for line in text.splitlines():
        if not line.startswith(_PREFIX):
            continue
        body = line[len(_PREFIX):]
        if body == "Compilation Cause":
            current, section = {"cause": "", "graph": "", "frames": [], "done": False}, "cause"
            blocks.append(current)
        elif current is None:
            continue
        elif body.startswith("Graph Info"):
            section = "graph"
        elif body.startswith("Python Frame"):
            section = "frames"
        elif body.startswith("=") and section == "end":
            current["done"] = True
        elif body.startswith("-"):
            section = "end"
        elif section == "cause":
            current["cause"] = body.strip()
        elif section == "graph" and body.strip().startswith("Graph Hash:"):
            current["graph"] = body.split(":", 1)[1].strip()
        elif section == "frames" and _FRAME.match(body):
            function, file, number = _FRAME.match(body).groups()
            current["frames"].append(Frame(function, file, int(number)))
    return [Compilation(block["cause"], block["graph"], tuple(block["frames"])) for block in blocks if block["done"]]


def stack_frames(frame=None) -> Tuple[Frame, ...]:
    """This thread's Python frames from ``frame`` (the caller's by default) outwards, as torch_xla lists them."""
    summary = traceback.extract_stack(frame or sys._getframe(1))
    return tuple(Frame(entry.name, entry.filename, entry.lineno or 0) for entry in reversed(summary))


def _package_dirs(names: Sequence[str]) -> Tuple[str, ...]:
    dirs = [os.path.dirname(module.__file__) + os.sep for name in names
            for module in [sys.modules.get(name)] if module is not None and getattr(module, "__file__", None)]
    return tuple(dirs)


def framework_dirs() -> Tuple[str, ...]:
    """Where torch, torch_xla and Python's own library live: frames a read or a compilation passes through."""
    return (*_package_dirs(("torch", "torch_xla")), sysconfig.get_paths()["stdlib"] + os.sep)


def engine_dirs() -> Tuple[str, ...]:
    """Where DeepSpeed and this package live: a read or a compilation in their code is not the user's."""
    return _package_dirs(("deepspeed", "deepspeed_xla"))


def library_dirs() -> Tuple[str, ...]:
    return framework_dirs() + engine_dirs()


def user_frame(frames: Sequence[Frame], libraries: Sequence[str] = ()) -> Optional[Frame]:
    """The innermost frame of the user's code: the first, innermost first, outside ``libraries``."""
    libraries = tuple(libraries) or library_dirs()
    return next((frame for frame in frames if not frame.file.startswith(libraries)
                 and not frame.file.startswith("<")), None)


def where(frame: Optional[Frame]) -> str:
    return f"{frame.file}:{frame.line}" if frame else "an unknown line (no Python frame outside the libraries)"


def warn_at(message: str, frame: Optional[Frame]) -> None:
    """A ``RuntimeWarning`` shown at the user's line (Python prints that line under it), else at the caller's."""
    if frame is None:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    else:
        warnings.warn_explicit(message, RuntimeWarning, frame.file, frame.line)


class Repeats:
    """How often each warning was given, to stop at ``REPEATS`` saying so."""

    def __init__(self):
        self.counts: Dict[tuple, int] = {}

    def note(self, key: tuple) -> Optional[str]:
        """The tail of the warning for ``key``'s next occurrence, None once it was given ``REPEATS`` times."""
        count = self.counts[key] = self.counts.get(key, 0) + 1
        if count > REPEATS:
            return None
        if count == REPEATS:
            return f" ({count} times at this line: deepspeed_xla does not warn of it again.)"
        return f" ({count} of at most {REPEATS} warnings for this line.)"


_STEP_END_CAUSE = ("the step's graph, which deepspeed_xla ends in engine.step(), is one XLA had not compiled: the step "
                   "traced other operations or shapes than the steps before it. Usually a batch of another shape (pad "
                   "or bucket batches to a few fixed shapes, drop_last=True for the last one), or a Python branch on "
                   "a step count or a value")
_READ_CAUSE = ("a read of a tensor's value on the host (.item(), .cpu(), print, a Python if on a tensor) ran the "
               "operations traced since the last step's end as a graph XLA had not compiled, and cut the step's "
               "graph in two. Read values after engine.step(), or every N steps")


def explain(compilation: Compilation, framework: Sequence[str] = (), engine: Sequence[str] = ()) -> str:
    """The cause torch_xla names, said in DeepSpeed's terms: a compilation that DeepSpeed's own code caused (a
    host-staged collective, its progress log) is said to be, never the user's read."""
    if compilation.at_step_end:
        return _STEP_END_CAUSE
    framework, engine = tuple(framework) or framework_dirs(), tuple(engine) or engine_dirs()
    inner = next((frame for frame in compilation.frames if not frame.file.startswith(framework)), None)
    if inner is not None and inner.file.startswith(engine):
        return (f"DeepSpeed's own code ({inner.function} at {inner.file}:{inner.line}) ran the operations traced so "
                "far as a graph XLA had not compiled: the step traced other operations or shapes than the steps "
                "before it (usually a batch of another shape)")
    if "access tensor value" in compilation.cause:
        return _READ_CAUSE
    return f"torch_xla gives the cause as \"{compilation.cause}\""


class Notice:
    """Rank 0's one line for a long compilation: started by a thread once the compilation has run for the notice
    time, ended with its duration by the sync's return (or given whole then, when the thread had not printed)."""

    def __init__(self, seconds: float, out=None):
        self.seconds, self._out = seconds, out
        self._lock = threading.Condition()
        self._armed: Optional[Tuple[str, float, int]] = None  # (graph, start, compiles before)
        self._printed = False
        threading.Thread(target=self._run, name="deepspeed_xla-compile-notice", daemon=True).start()

    def _write(self, text: str) -> None:
        out = self._out or sys.stderr
        out.write(text)
        out.flush()

    def _run(self) -> None:
        with self._lock:
            while True:
                self._lock.wait_for(lambda: self._armed is not None and not self._printed)
                graph, start, before = self._armed
                remaining = start + self.seconds - time.monotonic()
                if remaining > 0:
                    self._lock.wait(remaining)
                    continue  # disarmed or re-armed meanwhile, or the time has come: look again
                if xla_runtime.uncached_compiles() > before:
                    self._write(f"deepspeed_xla: compiling {graph}...")
                    self._printed = True
                else:
                    self._lock.wait(min(self.seconds, 1.0) or 0.05)  # not compiling (yet): a device lock wait

    def start(self, graph: str, compiles: int) -> None:
        with self._lock:
            self._armed, self._printed = (graph, time.monotonic(), compiles), False
            self._lock.notify_all()

    def end(self, compiled: bool) -> None:
        with self._lock:
            graph, start, _ = self._armed
            elapsed = time.monotonic() - start
            if self._printed:
                self._write(f" {elapsed:.0f} s\n")
            elif compiled and elapsed >= self.seconds:
                self._write(f"deepspeed_xla: compiling {graph}... {elapsed:.0f} s\n")
            self._armed, self._printed = None, False
            self._lock.notify_all()


class Watch:
    """This process's account of compilations at the ends of step graphs (see the module docstring)."""

    def __init__(self, config: Settings, rank: int):
        self.config, self.rank = config, rank
        self.repeats = Repeats()
        self.notice = Notice(config.notice_seconds) if rank == 0 else None
        self.compiling_since: Optional[Tuple[str, float, int]] = None  # what ``compiling`` reports to the watchdog
        self._path = os.environ.get("PT_XLA_DEBUG_FILE") if _analysis_level(os.environ) >= 1 else None
        self._offset = 0
        self._compiles = xla_runtime.uncached_compiles()  # at the end of the last graph
        self.expected: set = set()  # optimizer steps whose new graphs deepspeed_xla itself asked for

    def _analysis(self) -> List[Compilation]:
        """torch_xla's analysis blocks written since the last call (none where it writes none)."""
        if self._path is None:
            return []
        try:
            with open(self._path) as text:
                text.seek(self._offset)
                blocks = text.read()
        except OSError:
            return []
        self._offset += len(blocks.encode())
        return parse_analysis(blocks)

    def graph_end(self, graph: str, step: Optional[int], sync) -> None:
        """Run ``sync`` (the cut that ends ``graph``; ``step``: the optimizer step it ends, None for another graph)
        and say what it and the code since the last one compiled."""
        before = xla_runtime.uncached_compiles()
        self.compiling_since = (graph, time.monotonic(), before)
        if self.notice:
            self.notice.start(graph, before)
        try:
            sync()
        finally:
            after = xla_runtime.uncached_compiles()
            self.compiling_since = None
            if self.notice:
                self.notice.end(after > before)
        watched = step is not None and step > self.config.warmup and step not in self.expected
        if after > self._compiles and watched:
            self._warn(step, self._analysis(), after > before, stack_frames())
        elif after > self._compiles:
            self._analysis()  # read past the warm-up's compilations
        self._compiles = after

    def _warn(self, step: int, compilations: List[Compilation], at_end: bool, stack: Tuple[Frame, ...]) -> None:
        if not compilations and at_end:  # torch_xla does not analyse on this process: the sync's own frames
            compilations = [Compilation("", "", stack)]
        if not compilations:
            self._say(("read", None), None, step, "outside the step's end, at a line torch_xla's analysis names on "
                      "each host's first process only (its warning there names it)", _READ_CAUSE, "")
        for compilation in compilations:
            frame = user_frame(compilation.frames)
            graph = f", graph {compilation.graph}" if compilation.graph else ""
            analysis = f" (torch_xla's compilation analysis: \"{compilation.cause}\"{graph})" if compilation.cause \
                else ""
            self._say((compilation.at_step_end, frame), frame, step, f"at {where(frame)}", explain(compilation),
                      analysis)

    def _say(self, key: tuple, frame: Optional[Frame], step: int, at: str, cause: str, analysis: str) -> None:
        tail = self.repeats.note(key)
        if tail is None:
            return
        warn_at(f"deepspeed_xla: rank {self.rank} compiled a new graph in optimizer step {step}, after the "
                f"{self.config.warmup} warm-up steps ({WARMUP_ENV}), {at}: {cause}{analysis}. Each new graph costs a "
                f"compilation.{tail}", frame)


_watch: Optional[Watch] = None


def watch(rank: int) -> Optional[Watch]:
    """This process's ``Watch`` (None with ``DS_XLA_STEP_WARNINGS=0``)."""
    global _watch
    if _watch is None:
        config = process_settings()
        if not config.enabled:
            return None
        _watch = Watch(config, rank)
    return _watch


def graph_end(rank: int, graph: str, step: Optional[int], sync) -> None:
    """``sync`` the end of ``graph`` (of optimizer ``step``), watched (see ``Watch.graph_end``)."""
    current = watch(rank)
    if current is None:
        sync()
    else:
        current.graph_end(graph, step, sync)


def expect_compilations(rank: int, step: int) -> None:
    """The new graphs of optimizer ``step`` are deepspeed_xla's own choice (the flops profiler's timed steps run the
    step as three graphs): not warned of, as the user has nothing to change. Their compile notice stays."""
    current = watch(rank)
    if current is not None:
        current.expected.add(step)


def step_graph(step: int) -> str:
    return "the step graph (first step)" if step == 1 else f"the step graph (step {step})"


def compiling() -> Optional[Tuple[str, float]]:
    """What this process compiles now, and for how long (seconds), for the watchdog's messages: a graph whose end
    is being synced and which missed torch_xla's cache."""
    current = _watch.compiling_since if _watch is not None else None
    if current is None or xla_runtime.uncached_compiles() <= current[2]:
        return None
    return current[0], time.monotonic() - current[1]
