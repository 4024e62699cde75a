"""The heartbeat thread of one rank (``Watchdog``): it finds a dead or silent rank and stops the job naming it.

Every ``interval`` (a tenth of the heartbeat timeout, at most 5 s) the thread:
- beats: increments this rank's counter in the rendezvous store;
- watches the next rank in ring order that has not finished (so every live rank has one watcher): a counter that
  has not moved for the heartbeat timeout, or a process gone from this host (``processes``), is a failed rank;
- stops the job once a failure is known (``failure.FailureRecord``).
A rank that exits normally (``os._exit(0)`` included) marks itself done; rank 0, whose process hosts the store, exits
last. A rank that ended is a failure only for a rank that waits for it in a collective: the waiting rank's gloo op
fails when the ended process closes its connections, and rank 0, which stays until every rank is done, sees the ranks
that have waited for several intervals (``waiting``). An error the thread did not expect is printed once and the
thread goes on beating: a thread that ended silently would have its healthy rank blamed by the others.
"""
import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Dict, List, NoReturn, Optional

import torch.distributed as dist

from deepspeed_xla.comm import processes
from deepspeed_xla.comm.authentication import Signer
from deepspeed_xla.comm.failure import ENDED, EXIT_CODE, TERMINATED_EXIT_CODE, FailureRecord
from deepspeed_xla.comm.signals import SIGTERM_CAUSE
from deepspeed_xla.comm.timeouts import HEARTBEAT_ENV

PREFIX = "deepspeed_xla/watchdog/"
WAITS_BEFORE_FAILED = 3  # intervals a rank waits for one that ended before that is a failure: more than one
#                          interval, so a wait that just ended (its key is cleared within one) never counts
_REPORTS = 10  # distinct unexpected errors a rank prints; more would be the same bug in other words


def store_lost(error: Exception) -> str:
    """The failure when the store stops answering: its process, rank 0, is gone."""
    return f"lost the rendezvous store on rank 0 ({error}): rank 0 died or its host is unreachable"


class Watchdog:
    """The heartbeat thread of one rank (see the module docstring). ``heartbeat``: the heartbeat timeout, seconds;
    ``collective``: the collective timeout, seconds, for the errors that name it. ``connection``: this rank's one
    connection to the store for its control code (the preemption agreement's too, ``checkpoint``), never queued
    behind the job's, whose gloo rendezvous blocks in waits: rank 0 serves two connections per rank."""

    def __init__(self, store, rank: int, size: int, heartbeat: float, collective: float):
        self.rank, self.size = rank, size
        self.timeout, self.collective_timeout = heartbeat, collective
        self.interval = min(max(heartbeat / 10, 0.05), 5.0)
        self.connection = store.clone()
        self._store = dist.PrefixStore(PREFIX, self.connection)
        self._server = store  # rank 0: keeps the store's server up after destroy_process_group()
        self.signer = Signer(rank)  # the job's secret, if it has one: the store is open to whoever reaches it
        self.failures = FailureRecord(self._store, rank, self.signer)
        self._stopping = threading.Event()
        self._watched, self._count, self._since = None, None, 0.0
        self._processes: Dict[int, Optional[processes.Registered]] = {}  # as each rank registered itself
        self._finishing = False  # rank 0 at exit: it tells the others of a failure instead of stopping at once
        self._waiting_since: Optional[float] = None  # set by the job's thread while it waits on peers
        self._waits = 0  # this rank's waits so far, to tell one long wait from two
        self._waiting_key: Optional[str] = None  # the wait published under waiting/<rank>, if any
        self._compiling_key = ""  # the compilation published under compiling/<rank> (graph and start), if any
        self.collective = None  # what the job's thread waits in (a ``hang_report.Wait``), set by in_collective
        self._reported: set = set()  # the unexpected errors this thread printed
        self.pid = os.getpid()  # a forked child (a DataLoader worker) is not this rank
        self.sigterm = None  # this rank's ``signals.Sigterm``, once installed
        self.checkpoint = None  # this rank's ``preemption.CheckpointOnSigterm``, when the user asked for one
        self.exit_code = EXIT_CODE  # how this rank ends when it stops for the job's failure
        self._store.set(f"proc/{rank}", self.signer.sign(f"proc/{rank}", processes.registration(self.pid)))
        self._store.set(f"waiting/{rank}", "")  # every rank's key exists: rank 0 reads them all at once
        self._thread = threading.Thread(target=self._run, name="deepspeed_xla-watchdog", daemon=True)

    def start(self) -> None:
        self._store.add(f"beat/{self.rank}", 1)
        self._thread.start()

    # -- the thread
    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                self._store.add(f"beat/{self.rank}", 1)
            except (RuntimeError, OSError) as exc:  # the store's process (rank 0) is gone
                if self._stopping.is_set():
                    return
                failure = store_lost(exc)
            else:
                try:
                    failure = self._check()
                except dist.DistError:  # the store went since the beat: the next beat says so
                    continue
                except Exception as exc:  # noqa: BLE001  a bug or a malformed value: say so, and keep beating
                    self._report(exc)
                    continue
            if self.failures.raised:
                return
            if failure and self._finishing:
                self.failures.publish(failure)
            elif failure:
                self.stop_job(failure, self.exit_code)

    def _check(self) -> Optional[str]:
        """One interval's work after the beat: the failure found, if any."""
        if self.sigterm is not None and self.sigterm.arrived():
            self.terminated()
        if self.checkpoint is not None and self.checkpoint.overdue(self.timeout):
            self.stop_job(self.checkpoint.unsaved(self.timeout, HEARTBEAT_ENV), TERMINATED_EXIT_CODE)
        self._publish_waiting()
        self._publish_compiling()
        return self.failures.published() or self._check_watched()

    def _report(self, exc: Exception) -> None:
        """Print an unexpected error of the thread, once per kind."""
        key = f"{type(exc).__name__}: {exc}"[:300]
        if key in self._reported or len(self._reported) >= _REPORTS:
            return
        self._reported.add(key)
        sys.stderr.write(f"[deepspeed_xla] rank {self.rank}: the watchdog thread's check failed; it keeps beating, "
                         f"but the check fails until this is fixed (a bug: please report it):\n"
                         f"{traceback.format_exc()}")

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
            doing = self.compiling(target)
            last = f" (its last word: {doing.rpartition(' for ')[0]})" if doing else ""
            return (f"rank {target} sent no heartbeat for {self.timeout:g} s: it died, hung, or its host is "
                    f"unreachable{last} ({HEARTBEAT_ENV}={self.timeout:g})")
        return None

    def _publish_waiting(self) -> None:
        """Tell the store about a wait longer than one interval (which one, and in what), and clear it once it
        ended."""
        since = self._waiting_since
        long = since is not None and time.monotonic() - since > self.interval
        key = f"{self._waits} {self.collective or ''}" if long else None
        if key != self._waiting_key:
            self._store.set(f"waiting/{self.rank}", key or "")
            self._waiting_key = key

    def _publish_compiling(self) -> None:
        """Tell the store which graph this rank compiles, and since when (``compile_watch``), so that a peer that
        waits for it says so rather than calling it hung; cleared once the compilation ended."""
        from deepspeed_xla import compile_watch
        now = compile_watch.compiling()
        key = f"{time.time() - now[1]:.0f} {now[0]}" if now else ""
        if key.partition(" ")[2] != self._compiling_key.partition(" ")[2]:
            self._store.set(f"compiling/{self.rank}", key)
            self._compiling_key = key

    def compiling(self, rank: int) -> Optional[str]:
        """What ``rank`` said it compiles, and for how long so far (``compiling ... for 41 s``); None when not."""
        key = f"compiling/{rank}"
        value = self._store.get(key).decode() if self._store.check([key]) else ""
        since, _, graph = value.partition(" ")
        return f"compiling {graph} for {time.time() - float(since):.0f} s" if graph else None

    def _others(self) -> List[int]:
        """The other ranks, in ring order from this one."""
        return [(self.rank + offset) % self.size for offset in range(1, self.size)]

    def _running(self, rank: int) -> bool:
        return not self._store.check([f"done/{rank}"])

    def _waiting_ranks(self) -> dict:
        """Running ranks that have published a wait: rank -> which wait (every rank's key in one read)."""
        others = self._others()
        keys = [f"waiting/{rank}" for rank in others]
        if self._store.check(keys):
            waits = [wait.decode() for wait in self._store.multi_get(keys)]
        else:  # a rank that has not registered yet: reading its key would wait for it
            waits = [self._store.get(key).decode() if self._store.check([key]) else "" for key in keys]
        return {rank: wait for rank, wait in zip(others, waits) if wait and self._running(rank)}

    def waits(self) -> Dict[int, str]:
        """What each other running rank that has published a wait waits in (``hang_report.Wait`` as text)."""
        return {rank: wait.partition(" ")[2] for rank, wait in self._waiting_ranks().items()}

    def busy_ranks(self) -> list:
        """The other ranks that are running and not waiting on their peers: what a wait that timed out waited
        for, when none of them died."""
        waiting = self._waiting_ranks()
        return [rank for rank in sorted(self._others()) if rank not in waiting and self._running(rank)]

    def _next_running(self) -> Optional[int]:
        """The next rank after this one, in ring order, that has not finished."""
        return next((rank for rank in self._others() if self._running(rank)), None)

    def _process(self, rank: int) -> Optional[processes.Registered]:
        key = f"proc/{rank}"
        if rank not in self._processes and self._store.check([key]):
            value = self._store.get(key)
            text = self.signer.verify(key, value)
            try:
                self._processes[rank] = None if text is None else processes.parse(text)
            except ValueError:
                self._processes[rank] = None
                sys.stderr.write(f"[deepspeed_xla] rank {self.rank}: rank {rank} registered its process in the "
                                 f"rendezvous store as {text[:80]!r}, which is not a pid: it is watched by its "
                                 "heartbeat alone (a rank of another deepspeed_xla version, or another program "
                                 "writing to the job's MASTER_PORT)\n")
        return self._processes.get(rank)

    def _local_peer_gone(self, rank: int) -> Optional[str]:
        process = self._process(rank)
        if process is None or not processes.ended_here(process) or self._ended(rank):
            return None
        return f"rank {rank} (pid {process.pid}) exited unexpectedly: killed, out of memory, or crashed"

    def _local_peers_gone(self) -> Optional[str]:
        """The first other rank gone from this host without ending, if any."""
        return next(filter(None, map(self._local_peer_gone, sorted(self._others()))), None)

    # -- shared with the job's threads
    def published_failure(self) -> Optional[str]:
        return self.failures.published()

    def stop_job(self, failure: str, code: int = EXIT_CODE) -> NoReturn:
        """Print the job's first failure and end this process; rank 0's process hosts the store, and stays up until
        the others read the failure, for a few intervals."""
        linger = (lambda: self._until_every_rank_ended(WAITS_BEFORE_FAILED * self.interval)) if self.rank == 0 else None
        self.failures.stop(failure, code, linger)

    def terminated(self) -> None:
        """SIGTERM ends this rank as it would have, telling the peers why; unless it came because the job had
        already failed (a launcher stops the other ranks of its host when one dies), which stays the cause. With a
        checkpoint on SIGTERM asked for, the rank goes on to the checkpoint step instead (SIGTERMs after the first,
        such as the launcher's own, change nothing), for at most a heartbeat timeout without a step (``_check``)."""
        try:
            failure = self.published_failure() or self._local_peers_gone()
            if failure is None and self.checkpoint is not None:
                self.checkpoint.sigterm()
                return
        except (RuntimeError, OSError):  # the store is gone
            failure = None
        self.stop_job(failure or f"rank {self.rank} {SIGTERM_CAUSE}", TERMINATED_EXIT_CODE)

    def find_failure(self) -> Optional[str]:
        """After a collective failed: the failed rank, looked for for at most one heartbeat timeout (local peers at
        once, a silent one when the thread finds it). None sooner once every running peer has beaten since the
        search began: then none is dead."""
        deadline = time.monotonic() + self.timeout + 3 * self.interval  # the thread's pace, and some slack
        first = None
        while True:
            failure = self.published_failure() or self._local_peers_gone() or self._ended_peer()
            if failure:
                return failure
            beats = {rank: self._store.add(f"beat/{rank}", 0) for rank in self._others() if self._running(rank)}
            if first is None:
                first = beats
            elif all(count != first.get(rank) for rank, count in beats.items()) or time.monotonic() > deadline:
                return None
            time.sleep(self.interval)

    def _ended_peer(self) -> Optional[str]:
        ended = [rank for rank in sorted(self._others()) if not self._running(rank)]
        return f"rank {ended[0]} ended while rank {self.rank} waits in a collective" if ended else None

    def finish(self) -> None:
        """At exit: mark this rank done, unless the job failed; rank 0 keeps the store up until every
        rank is done (its thread still stops the job if one fails meanwhile), and stops the ranks that
        wait for it in a collective meanwhile. Rank 0 ending with the job's failure (it raised) keeps the
        store up until the others read it, for a few intervals: they poll every interval."""
        if os.getpid() != self.pid:
            return
        try:
            if self.published_failure() is None:
                self.failures.mark_ended("done")
                if self.rank == 0:
                    self._finishing = True
                    self._outlive_running_ranks()
            elif self.rank == 0:
                self._until_every_rank_ended(WAITS_BEFORE_FAILED * self.interval)
        except (RuntimeError, OSError):  # the store is gone: nobody is left to tell
            pass
        self._stopping.set()
        self._thread.join()

    def _outlive_running_ranks(self) -> None:
        """Rank 0 at exit keeps the store up for the running ranks. One that stays in the same wait for
        several intervals waits for this rank, which will not come: that is the job's failure."""
        first_seen, next_scan = {}, 0.0  # (rank, wait) -> when this rank first saw it
        while self._others_ended() < self.size - 1 and self.published_failure() is None:
            now = time.monotonic()
            if now >= next_scan:  # every rank's key: twice an interval, not at the pace of the exit check
                next_scan = now + self.interval / 2
                first_seen = {wait: first_seen.get(wait, now) for wait in self._waiting_ranks().items()}
                stuck = [rank for (rank, _), since in first_seen.items()
                         if now - since > WAITS_BEFORE_FAILED * self.interval]
                if stuck:
                    self.failures.publish(f"rank {self.rank} ended while rank {stuck[0]} waits in a collective")
            time.sleep(0.05)
        self._until_every_rank_ended(self.timeout)  # every rank reads the failure before the store goes

    def _others_ended(self) -> int:
        """Rank 0: how many other ranks finished or stopped (one read, whatever the job's size)."""
        return self._store.add(ENDED, 0)

    def _until_every_rank_ended(self, seconds: float) -> None:
        """Rank 0: wait, at most ``seconds``, until every other rank is done, stopped or gone from this host. The
        count is one read; the ranks of this host that ended without a word (killed) are looked for by pid."""
        local = [rank for rank in range(1, self.size)
                 if (process := self._process(rank)) is not None and process.namespace == processes.pid_namespace()]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            silent = [rank for rank in local if self._local_peer_gone(rank)]  # gone, and neither done nor stopped
            if self._others_ended() + len(silent) >= self.size - 1:
                return
            time.sleep(0.05)

    def _ended(self, rank: int) -> bool:
        """Whether ``rank`` finished, or stopped for the job's failure."""
        return not self._running(rank) or self._store.check([f"stopped/{rank}"])

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
            self.failures.publish(f"rank {self.rank} called os._exit({code})")
