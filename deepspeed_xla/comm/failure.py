"""The job's failure record: the first failure, under one key of the rendezvous store, which every rank prints as it
stops. Written once (``compare_set``): a rank that raises publishes its own exception, the heartbeat thread a rank
it found dead, SIGTERM the rank that got it; whatever comes later names the first."""
import os
import signal
import sys
import threading
from typing import Callable, NoReturn, Optional

from deepspeed_xla.comm.authentication import Signer

EXIT_CODE = 1
TERMINATED_EXIT_CODE = 128 + signal.SIGTERM  # how a shell reports a process that SIGTERM stopped
FAILED = "failed"
ENDED = "ended"  # how many ranks other than 0 have finished or stopped: what rank 0 reads at exit, in one operation
LONGEST = 1000  # characters of a failure that a rank prints: whoever reaches the store may write the key

_real_exit = os._exit  # before the watchdog replaces os._exit


def printable(text: str) -> str:
    """A failure read from the store, as one line a terminal shows as it is: control characters (escape sequences,
    line breaks that would forge other lines) escaped, at most ``LONGEST`` characters."""
    text = "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)
    return text if len(text) <= LONGEST else text[:LONGEST] + f"... ({len(text) - LONGEST} more characters)"


class FailureRecord:
    """One rank's side of the record, on the watchdog's connection to the store (a ``PrefixStore``); ``signer``: this
    rank's ``authentication.Signer``."""

    def __init__(self, store, rank: int, signer: Optional[Signer] = None):
        self.rank, self._store = rank, store
        self._signer = signer or Signer(rank)
        self.raised = False  # this rank is ending with an uncaught exception (its traceback says why)
        self._counted = False  # this rank is in the store's count of ended ranks
        self._stopped_by: Optional[int] = None  # the thread that stops this rank, once one does
        self._stop_lock = threading.RLock()  # re-entered by a signal handler on the main thread
        self.process_ends = threading.Event()  # what a second stop waits on: the first one ends the process

    def mark_ended(self, how: str) -> None:
        """This rank is ``done`` (finished) or ``stopped`` (for the job's failure). Counted once, however often it
        is said (``os._exit(0)`` from an exit handler after the watchdog's own)."""
        self._store.set(f"{how}/{self.rank}", "1")
        if self.rank != 0 and not self._counted:
            self._counted = True
            self._store.add(ENDED, 1)

    def published(self) -> Optional[str]:
        if self._store.check([FAILED]):
            text = self._signer.verify(FAILED, self._store.get(FAILED))
            return None if text is None else printable(text)
        return None

    def publish(self, failure: str) -> str:
        """Record ``failure`` unless another is recorded already; returns the recorded one (``failure`` when what
        holds the key is not the job's)."""
        text = self._signer.verify(FAILED, self._store.compare_set(FAILED, "", self._signer.sign(FAILED, failure)))
        return printable(failure if text is None else text)

    def publish_exception(self, kind: type, value: BaseException) -> None:
        """An uncaught exception ends this rank: it is the job's failure, unless another came first
        (then that one is printed, unless it is the same error raised on another rank)."""
        self.raised = True
        first_line = next((line for line in str(value).splitlines() if line.strip()), "")
        mine = f"rank {self.rank} raised {kind.__name__}: {first_line}"  # its own traceback has the rest
        first = self.publish(mine)
        if first.partition(" raised ")[2] != mine.partition(" raised ")[2]:
            sys.stderr.write(f"[deepspeed_xla] rank {self.rank} stops: {first}\n")

    def stop(self, failure: str, code: int, linger: Optional[Callable[[], None]] = None) -> NoReturn:
        """Print the job's first failure and end this process (a collective may hold the main thread); ``linger``
        runs between the two (rank 0, whose process hosts the store, stays until the others read the failure). Once:
        a second thread that comes here (the heartbeat thread, seeing the failure the main thread is stopping for)
        waits for the first to end the process; a signal handler that interrupts the stop on its own thread lets it
        go on."""
        with self._stop_lock:
            stopping, self._stopped_by = self._stopped_by, self._stopped_by or threading.get_ident()
        if stopping == threading.get_ident():
            return  # type: ignore[return-value]  # the interrupted stop ends the process
        if stopping is not None:
            self.process_ends.wait()
            return  # type: ignore[return-value]
        try:
            failure = self.publish(failure)
            self.mark_ended("stopped")
        except (RuntimeError, OSError):  # the store is gone: report what this rank saw
            pass
        sys.stderr.write(f"[deepspeed_xla] rank {self.rank} stops: {failure}\n")
        sys.stderr.flush()
        if linger is not None:
            try:
                linger()
            except (RuntimeError, OSError):  # the store went meanwhile
                pass
        _real_exit(code)
