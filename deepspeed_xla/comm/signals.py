"""SIGTERM on a rank: the peers learn why it stops (``Sigterm``).

Python runs a signal handler only in the main thread, between bytecodes, which a collective can hold for minutes:
the signal module's wakeup fd carries the signal to the heartbeat thread meanwhile (``arrived``). A forked child (a
DataLoader worker) is not the rank: it starts with SIGTERM's default action, no wakeup fd and none of the pipe's
fds. SIGTERM is blocked in the forking thread around ``fork()``, so one that comes meanwhile reaches the rank's
handler after the fork instead of killing it without a word.
"""
import os
import signal
import sys
import threading
from typing import Callable, Optional

#: Why a rank that got SIGTERM stops, after "rank N ".
SIGTERM_CAUSE = ("got SIGTERM: preempted (a spot VM, a TPU maintenance event), or stopped by its scheduler or "
                 "launcher")


class Sigterm:
    """The handler of one rank's process ``pid``; ``on_sigterm`` runs on the main thread (the handler) or on the
    heartbeat thread (``arrived``)."""

    def __init__(self, pid: int, on_sigterm: Callable[[], None]):
        self.pid, self.on_sigterm = pid, on_sigterm
        self.read, self.write = os.pipe()  # close-on-exec, as Python makes every fd
        for fd in (self.read, self.write):
            os.set_blocking(fd, False)
        self._mask_before_fork: Optional[set] = None
        self._pipe_lost = False

    @classmethod
    def catch(cls, pid: int, on_sigterm: Callable[[], None]) -> Optional["Sigterm"]:
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
        sigterm = cls(pid, on_sigterm)
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

    def installed(self) -> bool:
        return signal.getsignal(signal.SIGTERM) == self.handle

    def handle(self, signum, frame) -> None:
        if os.getpid() != self.pid:  # a child forked outside Python's fork hooks (a C library), before any reset
            self.uninstall()
            os.kill(os.getpid(), signum)
            return
        self.on_sigterm()

    def arrived(self) -> bool:
        """Whether SIGTERM came while this handler is installed (the wakeup fd has every handled signal). A pipe
        that something closed (EBADF) is said once; the handler still sees SIGTERM when the main thread runs."""
        if self._pipe_lost:
            return False
        try:
            received = os.read(self.read, 512)
        except BlockingIOError:
            return False
        except OSError as error:
            self._pipe_lost = True
            sys.stderr.write(f"[deepspeed_xla] the SIGTERM wakeup pipe of pid {self.pid} failed ({error}): something "
                             "closed its fd. SIGTERM is now seen only when the main thread runs Python, not while it "
                             "waits in a collective.\n")
            return False
        return signal.SIGTERM in received and self.installed()

    # The handler stays installed in the parent: with SIG_DFL there, a SIGTERM during the fork would kill the rank
    # without telling its peers. Blocked in the forking thread, it waits until the fork is done; the child inherits
    # the mask and resets SIGTERM before letting signals in (POSIX clears a child's pending signals).
    def _before_fork(self) -> None:
        if self.installed():
            self._mask_before_fork = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def _after_fork_in_parent(self) -> None:
        self._restore_mask()

    def _after_fork_in_child(self) -> None:
        if self.installed():
            self.uninstall()
        if not self._pipe_lost:  # a grandchild finds them closed already
            os.close(self.read)
            os.close(self.write)
            self._pipe_lost = True
        self._restore_mask()

    def _restore_mask(self) -> None:
        mask, self._mask_before_fork = self._mask_before_fork, None
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
