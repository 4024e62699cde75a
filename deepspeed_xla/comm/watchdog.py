"""Failed-rank watchdog: when a rank dies, goes silent or gets SIGTERM, every other rank exits within the heartbeat
timeout and says which rank failed, instead of waiting in a collective forever.

A rank blocked in a collective returns only when its peers take part: gloo (PJRT CPU) gives up after the process
group's timeout without saying why, XLA collectives (TPU) never give up, and a launcher stops only the ranks of its
own host. So the first process group of a rank (``watched``) starts its heartbeat thread (``heartbeat.Watchdog``),
an exception hook that publishes an uncaught exception as the job's failure (``failure``), an ``os._exit`` that
marks the rank done, and a SIGTERM handler that tells the peers (``signals``), or, when the user asked for a
checkpoint on SIGTERM, makes every rank save one first (``preemption``). A collective that fails names the failed
rank (``explain_failure``); one that times out while every rank waits, each in another collective, stops the job
with the collective each rank waits in (``in_collective``, ``hang_report``).

The two timeouts are apart (``timeouts``): the collective timeout is the process group's (``DS_XLA_COMM_TIMEOUT``
overrides it), the heartbeat timeout ``DS_XLA_HEARTBEAT_TIMEOUT`` (60 s by default).
"""
import atexit
import contextlib
import functools
import os
import resource
import sys
from datetime import timedelta
from typing import Callable, NoReturn, Optional

from deepspeed_xla.comm import failure, hang_report
from deepspeed_xla.comm.authentication import same_secret
from deepspeed_xla.comm.failure import EXIT_CODE, TERMINATED_EXIT_CODE
from deepspeed_xla.comm.heartbeat import Watchdog, store_lost
from deepspeed_xla.comm.preemption import SAVE_DIR_ENV, CheckpointOnSigterm, save_dir_setting
from deepspeed_xla.comm.signals import Sigterm
from deepspeed_xla.comm.timeouts import HEARTBEAT_ENV, TIMEOUT_ENV, comm_timeout, heartbeat_timeout

__all__ = ["EXIT_CODE", "TERMINATED_EXIT_CODE", "TIMEOUT_ENV", "HEARTBEAT_ENV", "comm_timeout", "start", "waiting",
           "in_collective", "watched", "explain_failure", "checkpoint_on_sigterm", "stop_after_checkpoint"]

_EXPLAINED = "_deepspeed_xla_explained"  # set on the errors explain_failure raises

_watchdog: Optional[Watchdog] = None


def start(store, rank: int, size: int, timeout: timedelta) -> None:
    """Start this process's watchdog (once, with the first process group: the world's); ``timeout``: the
    collective timeout."""
    global _watchdog
    if _watchdog is not None:
        return
    checkpoint_dir = save_dir_setting()
    if size < 2:
        if checkpoint_dir is not None:
            raise ValueError(f"{SAVE_DIR_ENV} is for jobs of 2 or more ranks (it makes them agree on a step to save "
                             "at), and this one has 1: unset it, and save from a SIGTERM handler of your own.")
        return
    if rank == 0:
        enough_files(size)
    _watchdog = build(store, rank, size, heartbeat_timeout(), timeout.total_seconds(), checkpoint_dir)
    same_secret(_watchdog._store, rank, _watchdog.signer, timeout)
    _watchdog.start()
    previous_hook = sys.excepthook

    def excepthook(kind, value, traceback):
        try:
            _watchdog.failures.publish_exception(kind, value)
        except (RuntimeError, OSError):  # the store is gone
            pass
        previous_hook(kind, value, traceback)

    sys.excepthook = excepthook
    atexit.register(_watchdog.finish)
    os._exit = _exit_telling_peers
    _watchdog.sigterm = Sigterm.catch(_watchdog.pid, _watchdog.terminated)
    if checkpoint_dir is not None and _watchdog.sigterm is None:
        raise ValueError(f"{SAVE_DIR_ENV} is set, but SIGTERM is handled already (a handler of the script or its "
                         "framework, or a signal wakeup fd) or the process group was made off the main thread: unset "
                         f"{SAVE_DIR_ENV}, or let deepspeed_xla handle SIGTERM.")


def enough_files(size: int) -> None:
    """Rank 0's process hosts the rendezvous store, which serves two connections per rank (the job's and the
    control code's): raise its open-file limit to cover them (a soft limit of 1024, common, falls at about 500 ranks),
    up to the hard limit, which only the administrator can raise (then a warning names ``ulimit -n``)."""
    needed = 2 * size + 512  # and what the process itself opens: libraries, XLA's files, the job's data
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    if raised < needed:
        sys.stderr.write(f"[deepspeed_xla] rank 0 hosts the rendezvous store for {size} ranks, which needs about "
                         f"{needed} open files, and its hard limit is {hard}: raise it (ulimit -Hn, or nofile in "
                         "/etc/security/limits.conf), or ranks will fail to connect.\n")


def build(store, rank: int, size: int, heartbeat: float, collective: float,
          checkpoint_dir: Optional[str]) -> Watchdog:
    """A rank's watchdog, not started, with its side of the checkpoint on SIGTERM if ``checkpoint_dir`` is set
    (what ``start`` starts; ``tests/comm/pod_simulation.py`` builds hundreds)."""
    dog = Watchdog(store, rank, size, heartbeat, collective)
    if checkpoint_dir is not None:
        dog.checkpoint = CheckpointOnSigterm(dog.connection, rank, checkpoint_dir, dog.signer)
    return dog


def _exit_telling_peers(code: int) -> NoReturn:
    """``os._exit`` while a watchdog runs: scripts end with it (torch_xla's examples do), and a peer that
    is still saving its checkpoint must not take that for a crash."""
    if os.getpid() == _watchdog.pid:
        try:
            _watchdog.exit_called(code)
        except (RuntimeError, OSError):  # the store is gone
            pass
    failure._real_exit(code)


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


@contextlib.contextmanager
def in_collective(wait: Optional[hang_report.Wait]):
    """Around a collective this rank runs: what its waits are in, for the report of a hang (None: unchanged)."""
    if _watchdog is None or wait is None:
        yield
        return
    previous, _watchdog.collective = _watchdog.collective, wait  # made text only when published: a thread's work
    try:
        yield
    finally:
        _watchdog.collective = previous


def watched(create_group: Callable) -> Callable:
    """A torch.distributed backend creator whose groups use the collective timeout; the first one (the
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
    try:
        busy, waits = _watchdog.busy_ranks(), _watchdog.waits()  # before the search: the other waits may time out
        found = _watchdog.find_failure()
    except (RuntimeError, OSError) as lost:  # the store went with its process, rank 0
        _watchdog.stop_job(store_lost(lost))
    if found:
        _watchdog.stop_job(found)
    if not busy and waits and _watchdog.collective:
        waits = {rank: hang_report.Wait.parse(wait) for rank, wait in waits.items()}
        waits[_watchdog.rank] = _watchdog.collective
        _watchdog.stop_job(f"{hang_report.report(waits, _watchdog.rank, _watchdog.collective_timeout, TIMEOUT_ENV)} "
                           f"{error}")
    doing = _watchdog.compiling(busy[0]) if busy else None
    if doing:
        explained = RuntimeError(
            f"rank {busy[0]} did not join the collective that rank {_watchdog.rank} waited in for {TIMEOUT_ENV}="
            f"{_watchdog.collective_timeout:g} s, and is alive: it is {doing} so far, not hung. Set {TIMEOUT_ENV} "
            f"(seconds) or DeepSpeed's timeout above the longest compilation. {error}")
    elif busy:
        explained = RuntimeError(
            f"rank {busy[0]} did not join the collective that rank {_watchdog.rank} waited in for {TIMEOUT_ENV}="
            f"{_watchdog.collective_timeout:g} s, and is alive: still compiling or computing (the first compilation "
            f"of a large model, a slower host) or on a code path the others did not take. If it is the compilation, "
            f"set {TIMEOUT_ENV} (seconds) or DeepSpeed's timeout above the longest one. {error}")
    else:
        explained = RuntimeError(f"a collective failed on rank {_watchdog.rank} and no rank was found dead within "
                                 f"{HEARTBEAT_ENV}={_watchdog.timeout:g} s: a rank may be hung. {error}")
    setattr(explained, _EXPLAINED, True)
    raise explained from error
