"""Failed-rank watchdog: when a rank dies or goes silent, every other rank exits within the comm
timeout and says which rank failed, instead of waiting in a collective forever.

A rank blocked in a collective returns only when its peers take part: gloo (PJRT CPU) gives up after
the process group's timeout without saying why, XLA collectives (TPU) never give up, and a launcher
stops only the ranks of its own host. So each rank runs a thread that, every ``interval``:
- beats: increments its counter in the rendezvous store;
- watches the next rank in ring order that has not finished (so every live rank has one watcher):
  a counter that has not moved for the timeout, or a process gone from this host, is a failed rank;
- stops the job once a failure is known: the first failure is published under one store key (a rank
  that raises publishes its own exception), and every rank that reads it prints it and exits with 1.
A rank that exits normally (``os._exit(0)`` included) marks itself done; rank 0, whose process hosts the
store, exits last. A rank that ended is a failure only for a rank that waits for it in a collective: the
waiting rank's gloo op fails when the ended process closes its connections, and rank 0, which stays until
every rank is done, sees the ranks that have waited for several intervals (``waiting()``). A rank that
gets SIGTERM (preempted) tells the others before it ends (``_Sigterm``), or, when the user asked for a checkpoint on
SIGTERM, every rank saves one first (``comm/preemption.py``).

The timeout is the process group's (DeepSpeed: ``init_distributed(timeout=...)``, default 10 min,
``DEEPSPEED_TIMEOUT`` in minutes); ``DS_XLA_COMM_TIMEOUT`` (seconds) overrides it.
"""
import atexit
import contextlib
import functools
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, NoReturn, Optional

import torch.distributed as dist

from deepspeed_xla import env_vars
from deepspeed_xla.comm.preemption import SAVE_DIR_ENV, CheckpointOnSigterm, save_dir_setting

TIMEOUT_ENV = "DS_XLA_COMM_TIMEOUT"
EXIT_CODE = 1
TERMINATED_EXIT_CODE = 128 + signal.SIGTERM  # how a shell reports a process that SIGTERM stopped
_EXPLAINED = "_deepspeed_xla_explained"  # set on the errors explain_failure raises
_PREFIX = "deepspeed_xla/watchdog/"
_FAILED = "failed"
_WAITS_BEFORE_FAILED = 3  # intervals a rank waits for one that ended before that is a failure: more than one
#                           interval, so a wait that just ended (its key is cleared within one) never counts

_watchdog: Optional["Watchdog"] = None
_real_exit = os._exit


def comm_timeout(default: timedelta) -> timedelta:
    """The collective timeout: ``DS_XLA_COMM_TIMEOUT`` seconds if set, else the process group's."""
    seconds = env_vars.positive_number(os.environ, TIMEOUT_ENV, "a number of seconds such as 600")
    return default if seconds is None else timedelta(seconds=seconds)


@functools.lru_cache(maxsize=None)
def pid_namespace() -> str:
    """Where this process's pid means this process: the kernel's boot id and the PID namespace. A hostname is not
    enough: containers on the host network and cloned VMs share it, and their pids are not ours to look up."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot_id = handle.read().strip()
        namespace = os.stat("/proc/self/ns/pid")
    except OSError:  # not Linux: the hostname is what there is
        return socket.gethostname()
    return f"{boot_id}:{namespace.st_dev}:{namespace.st_ino}"


def _process_started(pid: int) -> float:
    import psutil
    return psutil.Process(pid).create_time()


def _local_process_gone(pid: int, started: float) -> bool:
    """Whether ``pid`` (started at ``started``) has exited, including a zombie its parent did not reap yet."""
    import psutil
    try:
        process = psutil.Process(pid)
        return process.create_time() != started or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Watchdog:
    """The heartbeat thread of one rank (see the module docstring)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, checkpoint_dir: Optional[str] = None):
        self.rank, self.size = rank, size
        self.timeout = timeout.total_seconds()
        self.interval = min(max(self.timeout / 10, 0.05), 5.0)
        self._store = dist.PrefixStore(_PREFIX, store.clone())  # own connection: never queued behind the job's
        self._server = store  # rank 0: keeps the store's server up after destroy_process_group()
        self._stopping = threading.Event()
        self._watched, self._count, self._since = None, None, 0.0
        self._processes = {}  # rank -> (pid namespace, pid, start time), as each rank registered itself
        self._raised = False  # this rank is ending with an uncaught exception (its traceback says why)
        self._finishing = False  # rank 0 at exit: it tells the others of a failure instead of stopping at once
        self._waiting_since: Optional[float] = None  # set by the job's thread while it waits on peers
        self._waits = 0  # this rank's waits so far, to tell one long wait from two
        self._waiting_key: Optional[str] = None  # the wait published under waiting/<rank>, if any
        self.pid = os.getpid()  # a forked child (a DataLoader worker) is not this rank
        self.sigterm: Optional[_Sigterm] = None  # when this rank names SIGTERM to its peers
        self.checkpoint = None if checkpoint_dir is None else CheckpointOnSigterm(store, rank, checkpoint_dir)
        self.exit_code = EXIT_CODE  # how this rank ends when it stops for the job's failure
        self._stopped_by: Optional[int] = None  # the thread that stops this rank, once one does
        self._stop_lock = threading.RLock()  # re-entered by a signal handler on the main thread
        self._store.set(f"proc/{rank}", f"{pid_namespace()} {os.getpid()} {_process_started(os.getpid())}")
        self._thread = threading.Thread(target=self._run, name="deepspeed_xla-watchdog", daemon=True)

    def start(self) -> None:
        self._store.add(f"beat/{self.rank}", 1)
        self._thread.start()

    # -- the thread
    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            if self.sigterm is not None and self.sigterm.arrived():
                self.terminated()
            try:
                self._store.add(f"beat/{self.rank}", 1)
                self._publish_waiting()
                failure = self.published_failure() or self._check_watched()
            except (RuntimeError, OSError) as exc:  # the store's process (rank 0) is gone
                if self._stopping.is_set():
                    return
                failure = f"lost the rendezvous store on rank 0 ({exc}): rank 0 died or its host is unreachable"
            if self._raised:
                return
            if failure and self._finishing:
                self.publish(failure)
            elif failure:
                self.stop_job(failure, self.exit_code)

    def _check_watched(self) -> Optional[str]:
        target = self._next_running()
        if target is None:
            return None
        now = time.monotonic()
        if target != self._watched:
            self._watched, self._count, self._since = target, None, now
        gone = self._local_peer_gone(target)
        if gone:
            return gone
        count = self._store.add(f"beat/{target}", 0)
        if count != self._count:
            self._count, self._since = count, now
        elif now - self._since > self.timeout:
            return (f"rank {target} sent no heartbeat for {self.timeout:g} s: it died, hung, or its host is "
                    f"unreachable ({TIMEOUT_ENV}={self.timeout:g})")
        return None

    def _publish_waiting(self) -> None:
        """Tell the store about a wait longer than one interval, and clear it once it ended."""
        since = self._waiting_since
        key = f"{self._waits}" if since is not None and time.monotonic() - since > self.interval else None
        if key != self._waiting_key:
            self._store.set(f"waiting/{self.rank}", key or "")
            self._waiting_key = key

    def _waiting_ranks(self) -> dict:
        """Running ranks that have published a wait: rank -> which wait."""
        ranks = {}
        for offset in range(1, self.size):
            rank = (self.rank + offset) % self.size
            if not self._store.check([f"done/{rank}"]) and self._store.check([f"waiting/{rank}"]):
                wait = self._store.get(f"waiting/{rank}").decode()
                if wait:
                    ranks[rank] = wait
        return ranks

    def busy_ranks(self) -> list:
        """The other ranks that are running and not waiting on their peers: what a wait that timed out waited
        for, when none of them died."""
        waiting = self._waiting_ranks()
        return [rank for rank in range(self.size)
                if rank != self.rank and rank not in waiting and not self._store.check([f"done/{rank}"])]

    def _next_running(self) -> Optional[int]:
        """The next rank after this one, in ring order, that has not finished."""
        for offset in range(1, self.size):
            rank = (self.rank + offset) % self.size
            if not self._store.check([f"done/{rank}"]):
                return rank
        return None

    def _process(self, rank: int):
        if rank not in self._processes and self._store.check([f"proc/{rank}"]):
            namespace, pid, started = self._store.get(f"proc/{rank}").decode().split()
            self._processes[rank] = (namespace, int(pid), float(started))
        return self._processes.get(rank)

    def _local_peer_gone(self, rank: int) -> Optional[str]:
        process = self._process(rank)
        if process is None:
            return None
        namespace, pid, started = process
        if namespace != pid_namespace() or not _local_process_gone(pid, started):
            return None
        if self._ended(rank):
            return None
        return f"rank {rank} (pid {pid}) exited unexpectedly: killed, out of memory, or crashed"

    def _local_peers_gone(self) -> Optional[str]:
        """The first other rank gone from this host without ending, if any."""
        return next(filter(None, (self._local_peer_gone(rank) for rank in range(self.size) if rank != self.rank)),
                    None)

    # -- shared with the job's threads
    def published_failure(self) -> Optional[str]:
        if self._store.check([_FAILED]):
            return self._store.get(_FAILED).decode()
        return None

    def publish(self, failure: str) -> str:
        """Record ``failure`` unless another is recorded already; returns the recorded one."""
        return self._store.compare_set(_FAILED, "", failure).decode()

    def publish_exception(self, kind: type, value: BaseException) -> None:
        """An uncaught exception ends this rank: it is the job's failure, unless another came first
        (then that one is printed, unless it is the same error raised on another rank)."""
        self._raised = True
        first_line = next((line for line in str(value).splitlines() if line.strip()), "")
        mine = f"rank {self.rank} raised {kind.__name__}: {first_line}"  # its own traceback has the rest
        first = self.publish(mine)
        if first.partition(" raised ")[2] != mine.partition(" raised ")[2]:
            sys.stderr.write(f"[deepspeed_xla] rank {self.rank} stops: {first}\n")

    def stop_job(self, failure: str, code: int = EXIT_CODE) -> NoReturn:
        """Print the job's first failure and end this process (a collective may hold the main thread). Rank 0's
        process hosts the store: it stays up until the others read the failure, for a few intervals. Once: a second
        thread that comes here (the watchdog's, seeing the failure the main thread is stopping for) waits for the
        first to end the process; a signal handler that interrupts the stop on its own thread lets it go on."""
        with self._stop_lock:
            stopping, self._stopped_by = self._stopped_by, self._stopped_by or threading.get_ident()
        if stopping == threading.get_ident():
            return  # type: ignore[return-value]  # the interrupted stop ends the process
        if stopping is not None:
            threading.Event().wait()
        try:
            failure = self.publish(failure)
            self._store.set(f"stopped/{self.rank}", "1")
        except (RuntimeError, OSError):  # the store is gone: report what this rank saw
            pass
        sys.stderr.write(f"[deepspeed_xla] rank {self.rank} stops: {failure}\n")
        sys.stderr.flush()
        if self.rank == 0:
            with contextlib.suppress(RuntimeError, OSError):
                self._until_every_rank_ended(_WAITS_BEFORE_FAILED * self.interval)
        _real_exit(code)

    def terminated(self) -> None:
        """SIGTERM ends this rank as it would have, telling the peers why; unless it came because the job had
        already failed (a launcher stops the other ranks of its host when one dies), which stays the cause. With a
        checkpoint on SIGTERM asked for, the rank goes on to the checkpoint step instead (SIGTERMs after the first,
        such as the launcher's own, change nothing)."""
        try:
            failure = self.published_failure() or self._local_peers_gone()
            if failure is None and self.checkpoint is not None:
                self.checkpoint.sigterm()
                return
        except (RuntimeError, OSError):  # the store is gone
            failure = None
        self.stop_job(failure or f"rank {self.rank} got SIGTERM: preempted (a spot VM, a TPU maintenance event), or "
                      "stopped by its scheduler or launcher", TERMINATED_EXIT_CODE)

    def find_failure(self) -> Optional[str]:
        """A failed rank, looked for until the timeout: local peers at once, the others by heartbeat."""
        deadline = time.monotonic() + self.timeout + 2 * self.interval
        while True:
            failure = self.published_failure() or self._local_peers_gone()
            ended = [rank for rank in range(self.size) if rank != self.rank and self._store.check([f"done/{rank}"])]
            if ended and not failure:
                failure = f"rank {ended[0]} ended while rank {self.rank} waits in a collective"
            if failure or time.monotonic() > deadline:
                return failure
            time.sleep(self.interval)

    def finish(self) -> None:
        """At exit: mark this rank done, unless the job failed; rank 0 keeps the store up until every
        rank is done (its thread still stops the job if one fails meanwhile), and stops the ranks that
        wait for it in a collective meanwhile. Rank 0 ending with the job's failure (it raised) keeps the
        store up until the others read it, for a few intervals: they poll every interval."""
        if os.getpid() != self.pid:
            return
        try:
            if self.published_failure() is None:
                self._store.set(f"done/{self.rank}", "1")
                if self.rank == 0:
                    self._finishing = True
                    self._outlive_running_ranks()
            elif self.rank == 0:
                self._until_every_rank_ended(_WAITS_BEFORE_FAILED * self.interval)
        except (RuntimeError, OSError):  # the store is gone: nobody is left to tell
            pass
        self._stopping.set()
        self._thread.join()

    def _outlive_running_ranks(self) -> None:
        """Rank 0 at exit keeps the store up for the running ranks. One that stays in the same wait for
        several intervals waits for this rank, which will not come: that is the job's failure."""
        first_seen, next_scan = {}, 0.0  # (rank, wait) -> when this rank first saw it
        while self._next_running() is not None and self.published_failure() is None:
            now = time.monotonic()
            if now >= next_scan:  # every rank's key: twice an interval, not at the pace of the exit check
                next_scan = now + self.interval / 2
                first_seen = {wait: first_seen.get(wait, now) for wait in self._waiting_ranks().items()}
                stuck = [rank for (rank, _), since in first_seen.items()
                         if now - since > _WAITS_BEFORE_FAILED * self.interval]
                if stuck:
                    self.publish(f"rank {self.rank} ended while rank {stuck[0]} waits in a collective")
            time.sleep(0.05)
        self._until_every_rank_ended(self.timeout)  # every rank reads the failure before the store goes

    def _until_every_rank_ended(self, seconds: float) -> None:
        """Rank 0: wait, at most ``seconds``, until every other rank is done, stopped or gone from this host."""
        running = set(range(1, self.size))
        deadline = time.monotonic() + seconds
        while running and time.monotonic() < deadline:
            running = {rank for rank in running if not (self._ended(rank) or self._local_peer_gone(rank))}
            time.sleep(0.05)

    def _ended(self, rank: int) -> bool:
        """Whether ``rank`` finished, or stopped for the job's failure."""
        return self._store.check([f"done/{rank}"]) or self._store.check([f"stopped/{rank}"])

    @contextlib.contextmanager
    def waiting(self):
        self._waits += 1
        self._waiting_since = time.monotonic()
        try:
            yield
        finally:
            self._waiting_since = None

    def exit_called(self, code: int) -> None:
        """``os._exit(code)`` skips atexit: 0 ends this rank like a normal exit, anything else fails the job."""
        if code == 0:
            self.finish()
        else:
            self.publish(f"rank {self.rank} called os._exit({code})")


def start(store, rank: int, size: int, timeout: timedelta) -> None:
    """Start this process's watchdog (once, with the first process group: the world's)."""
    global _watchdog
    if _watchdog is not None:
        return
    checkpoint_dir = save_dir_setting()
    if size < 2:
        if checkpoint_dir is not None:
            raise ValueError(f"{SAVE_DIR_ENV} is for jobs of 2 or more ranks (it makes them agree on a step to save "
                             "at), and this one has 1: unset it, and save from a SIGTERM handler of your own.")
        return
    _watchdog = Watchdog(store, rank, size, timeout, checkpoint_dir)
    _watchdog.start()
    previous_hook = sys.excepthook

    def excepthook(kind, value, traceback):
        try:
            _watchdog.publish_exception(kind, value)
        except (RuntimeError, OSError):  # the store is gone
            pass
        previous_hook(kind, value, traceback)

    sys.excepthook = excepthook
    atexit.register(_watchdog.finish)
    os._exit = _exit_telling_peers
    _watchdog.sigterm = _Sigterm.catch(_watchdog)
    if checkpoint_dir is not None and _watchdog.sigterm is None:
        raise ValueError(f"{SAVE_DIR_ENV} is set, but SIGTERM is handled already (a handler of the script or its "
                         "framework, or a signal wakeup fd) or the process group was made off the main thread: unset "
                         f"{SAVE_DIR_ENV}, or let deepspeed_xla handle SIGTERM.")


class _Sigterm:
    """SIGTERM tells the peers why this rank stops (``catch``). Python runs a signal handler only in the main
    thread, between bytecodes, which a collective can hold for minutes: the wakeup fd carries the signal to the
    watchdog thread meanwhile (``arrived``)."""

    def __init__(self, watchdog: Watchdog):
        self.watchdog = watchdog
        self.read, self.write = os.pipe()
        for fd in (self.read, self.write):
            os.set_blocking(fd, False)
        self._paused = False

    @classmethod
    def catch(cls, watchdog: Watchdog) -> Optional["_Sigterm"]:
        """Install, unless something else handles SIGTERM (a framework's handler, asyncio's wakeup fd) or this
        is not the main thread (only it may set handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
            return None
        in_use = signal.set_wakeup_fd(-1)
        if in_use != -1:
            signal.set_wakeup_fd(in_use)
            return None
        sigterm = cls(watchdog)
        sigterm.install()
        os.register_at_fork(before=sigterm._before_fork, after_in_parent=sigterm._after_fork_in_parent,
                            after_in_child=sigterm._after_fork_in_child)
        return sigterm

    def install(self) -> None:
        signal.set_wakeup_fd(self.write, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self.handle)

    def uninstall(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)

    def handle(self, signum, frame) -> None:
        if os.getpid() != self.watchdog.pid:  # a child forked off another thread, before it reset SIGTERM
            self.uninstall()
            os.kill(os.getpid(), signum)
            return
        self.watchdog.terminated()

    def arrived(self) -> bool:
        """Whether SIGTERM came while this handler is installed (the wakeup fd has every handled signal)."""
        try:
            received = os.read(self.read, 512)
        except BlockingIOError:
            return False
        return signal.SIGTERM in received and signal.getsignal(signal.SIGTERM) == self.handle

    # A forked child (a DataLoader worker) is not the rank: it starts with SIGTERM's default and no wakeup fd,
    # since the fd it would inherit is the rank's. Forks off the main thread can only reset in the child.
    def _before_fork(self) -> None:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == self.handle:
            self.uninstall()
            self._paused = True

    def _after_fork_in_parent(self) -> None:
        if self._paused:
            self._paused = False
            self.install()

    def _after_fork_in_child(self) -> None:
        self._paused = False
        if signal.getsignal(signal.SIGTERM) == self.handle:
            self.uninstall()


def _exit_telling_peers(code: int) -> NoReturn:
    """``os._exit`` while a watchdog runs: scripts end with it (torch_xla's examples do), and a peer that
    is still saving its checkpoint must not take that for a crash."""
    if os.getpid() == _watchdog.pid:
        try:
            _watchdog.exit_called(code)
        except (RuntimeError, OSError):  # the store is gone
            pass
    _real_exit(code)


def checkpoint_on_sigterm() -> Optional[CheckpointOnSigterm]:
    """This rank's side of the checkpoint on SIGTERM, when the user asked for one."""
    return _watchdog.checkpoint if _watchdog is not None else None


def stop_after_checkpoint(save: Callable[[], None], reason: str) -> NoReturn:
    """Save the checkpoint on SIGTERM, then stop this rank with SIGTERM's exit code. A peer that stops first
    publishes the same reason, which this rank may read meanwhile: it ends with that code too."""
    _watchdog.exit_code = TERMINATED_EXIT_CODE
    save()
    _watchdog.stop_job(reason, TERMINATED_EXIT_CODE)


def waiting():
    """Around a blocking wait on peers: while it lasts, a rank that ended is this rank's failure."""
    return _watchdog.waiting() if _watchdog is not None else contextlib.nullcontext()


def watched(create_group: Callable) -> Callable:
    """A torch.distributed backend creator whose groups use the comm timeout; the first one (the
    world's) starts this process's watchdog."""

    @functools.wraps(create_group)
    def create(store, rank: int, size: int, timeout: timedelta):
        timeout = comm_timeout(timeout)
        group = create_group(store, rank, size, timeout)
        start(store, rank, size, timeout)
        return group

    return create


def explain_failure(error: Exception) -> NoReturn:
    """A collective failed: stop the job naming the failed rank, or re-raise saying none was found. An error this
    function raised passes through unchanged (a collective issued inside another one's start)."""
    if _watchdog is None or getattr(error, _EXPLAINED, False):
        raise error
    busy = _watchdog.busy_ranks()
    failure = _watchdog.find_failure()
    if failure:
        _watchdog.stop_job(failure)
    if busy:
        explained = RuntimeError(
            f"rank {busy[0]} did not join the collective that rank {_watchdog.rank} waited in for {TIMEOUT_ENV}="
            f"{_watchdog.timeout:g} s, and is alive: still compiling or computing (the first compilation of a "
            f"large model, a slower host) or on a code path the others did not take. If it is the compilation, "
            f"set {TIMEOUT_ENV} (seconds) or DeepSpeed's timeout above the longest one. {error}")
    else:
        explained = RuntimeError(f"a collective failed on rank {_watchdog.rank} and no rank was found dead within "
                                 f"{_watchdog.timeout:g} s ({TIMEOUT_ENV}): a rank may be hung. {error}")
    setattr(explained, _EXPLAINED, True)
    raise explained from error
