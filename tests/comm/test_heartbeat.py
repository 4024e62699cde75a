"""``comm/heartbeat.py``: the heartbeat thread against a real rendezvous store, its peers played by this test. (The
watchdog in running jobs: tests/launched/test_faults.py.)"""
import os
import resource
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from deepspeed_xla.comm import failure, heartbeat, watchdog
from deepspeed_xla.launch_env import free_port

INTERVAL = 0.02  # the thread's pace in these tests; the heartbeat timeout stays a minute, so no peer is failed


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)


@pytest.fixture
def dogs(store, monkeypatch):
    """Rank 0's and rank 1's watchdogs on one store, not started; stopped at the end. A stop records its code."""
    exits = []
    monkeypatch.setattr(failure, "_real_exit", exits.append)
    made = [heartbeat.Watchdog(store, rank, 2, heartbeat=60.0, collective=600.0) for rank in (0, 1)]
    for dog in made:
        dog.interval = INTERVAL
        dog.exits = exits
    yield made
    for dog in made:
        dog._stopping.set()
        if dog._thread.is_alive():
            dog._thread.join()


def _beats(dog, rank: int) -> int:
    return dog._store.add(f"beat/{rank}", 0)


def _until(condition, what: str, seconds: float = 30.0) -> None:
    """Poll ``condition`` (a bound, not a pace: the test fails if it does not hold within ``seconds``)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(INTERVAL)


class _Unexpected(Exception):
    """What psutil.AccessDenied was: an error no except clause of the thread named."""


class _FailingSigterm:
    def arrived(self):
        raise _Unexpected("the check broke")


def test_an_unexpected_error_is_said_once_and_the_thread_keeps_beating(dogs, capsys):
    """A thread that ended on an error its code did not expect stopped beating, and a peer then stopped the job
    blaming this healthy rank."""
    dog, _ = dogs
    dog.sigterm = _FailingSigterm()
    dog.start()
    _until(lambda: _beats(dog, 0) > 10, "the thread stopped beating")
    assert dog._thread.is_alive() and not dog.exits
    err = capsys.readouterr().err
    assert err.count("the watchdog thread's check failed; it keeps beating") == 1, err
    assert "_Unexpected: the check broke" in err, err


def test_a_malformed_registration_is_said_once_and_its_rank_is_watched_by_heartbeat(dogs, capsys):
    dog, peer = dogs
    dog._store.set("proc/1", "not a pid")
    dog.start()
    _until(lambda: _beats(dog, 0) > 10, "the thread stopped beating")
    assert dog._thread.is_alive() and not dog.exits
    err = capsys.readouterr().err
    assert err.count("rank 1 registered its process in the rendezvous store as 'not a pid'") == 1, err
    dog.timeout = 0.2  # rank 1 never beats: its heartbeat still fails it
    _until(lambda: dog.exits, "the silent rank was not found")
    assert "rank 0 stops: rank 1 sent no heartbeat for 0.2 s" in capsys.readouterr().err


def test_after_a_failed_collective_live_peers_are_told_apart_in_intervals_not_the_timeout(dogs):
    """A collective that timed out while every peer lives: the search ends once each has beaten, within a few
    intervals, not after another heartbeat timeout (a minute here)."""
    dog, peer = dogs
    peer.start()
    began = time.monotonic()
    assert dog.find_failure() is None
    assert time.monotonic() - began < 50 * INTERVAL


def test_a_rank_that_compiles_says_so_to_its_peers(dogs, monkeypatch):
    """What ``compile_watch`` says this rank compiles reaches the store at the next interval, with its start, and
    is cleared when it ends: a peer's message then calls the rank compiling, not hung."""
    from deepspeed_xla import compile_watch
    dog, peer = dogs
    monkeypatch.setattr(compile_watch, "compiling", lambda: ("the step graph (first step)", 41.2))
    dog._publish_compiling()
    _until(lambda: peer.compiling(0) is not None, "the compilation was not published")  # a store's set is not acked
    assert peer.compiling(0) in {f"compiling the step graph (first step) for {seconds} s" for seconds in (41, 42)}
    monkeypatch.setattr(compile_watch, "compiling", lambda: None)
    dog._publish_compiling()
    _until(lambda: peer.compiling(0) is None, "the compilation's end was not published")
    assert peer.compiling(1) is None


def test_after_a_failed_collective_a_silent_peer_is_named_within_the_heartbeat_timeout(dogs):
    dog, _ = dogs
    dog.timeout = 1.0
    dog.start()
    _until(lambda: dog._watched == 1, "the thread does not watch rank 1")  # as it has long before a collective fails
    began = time.monotonic()
    assert dog.find_failure() == ("rank 1 sent no heartbeat for 1 s: it died, hung, or its host is unreachable "
                                  "(DS_XLA_HEARTBEAT_TIMEOUT=1)")
    assert time.monotonic() - began < 1.0 + 20 * INTERVAL


def test_a_forked_child_ending_does_not_finish_the_rank(dogs):
    """DataLoader workers are forked from a rank and end with ``os._exit``: the rank itself has not finished."""
    dog, _ = dogs
    dog.pid = os.getpid() + 1  # what a forked child sees: the watchdog belongs to its parent
    dog.finish()
    dog.exit_called(0)
    assert not dog._store.check(["done/0"])


def test_a_live_local_peer_is_watched_without_being_reported(dogs):
    """Rank 1 registered this very process (same host, same PID namespace): alive, it is not reported."""
    dog, _ = dogs
    assert dog._local_peer_gone(1) is None and dog._local_peers_gone() is None


class _Counted:
    """A store that counts the operations made through it."""

    def __init__(self, store):
        self._inner, self.ops = store, 0

    def __getattr__(self, name):
        method = getattr(self._inner, name)

        def counted(*args, **kwargs):
            self.ops += 1
            return method(*args, **kwargs)

        return counted


@pytest.mark.parametrize("size", [8, 256])
def test_rank_0_at_exit_reads_the_store_at_a_pace_that_does_not_grow_with_the_job(store, monkeypatch, size):
    """Rank 0 keeps the store up at exit until every rank ended: it used to read two keys of every rank twice an
    interval (3,800 operations a second more at 512 ranks in tests/comm/pod_simulation.py) and, at the end, every 50
    ms. Now one counter every 50 ms, and every rank's wait in one read twice an interval: about 80 a second here, at
    any size."""
    monkeypatch.setattr(failure, "_real_exit", lambda code: None)
    dog = heartbeat.Watchdog(store, 0, size, heartbeat=60.0, collective=600.0)
    dog.interval = 0.1
    for rank in range(1, size):  # registered, as each rank's watchdog does at its start
        dog._store.set(f"waiting/{rank}", "")
    dog._store = dog.failures._store = counted = _Counted(dog._store)
    dog._thread = threading.Thread(target=dog._stopping.wait)  # the heartbeat thread, without its own reads
    dog._thread.start()
    exiting = threading.Thread(target=dog.finish)
    exiting.start()
    time.sleep(1.0)  # the pace under test: operations over one second of rank 0 waiting
    ops = counted.ops
    dog._store.add("ended", size - 1)  # every other rank finished
    exiting.join(30)
    assert not exiting.is_alive()
    assert ops < 150, f"{ops} store operations in one second of rank 0's wait, for {size} ranks"


def test_the_watchdog_and_the_sigterm_agreement_share_one_connection(store, tmp_path):
    """Rank 0's process serves every connection to the store: the job's, and one per rank for the control code (the
    checkpoint on SIGTERM used to open a third)."""
    from tests.comm.pod_simulation import served_sockets
    before = served_sockets(store.port)
    dog = watchdog.build(store, 1, 2, 60.0, 600.0, str(tmp_path))
    assert dog.checkpoint is not None and served_sockets(store.port) == before + 1


def test_rank_0_raises_its_open_file_limit_for_the_job(monkeypatch, capsys):
    """Two connections per rank: a soft limit of 1024 fell at about 500 ranks (340 with three)."""
    limits = {"soft": 1024, "hard": 4096}
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limits["soft"], limits["hard"]))
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limits.update(soft=value[0]))
    watchdog.enough_files(64)
    assert limits["soft"] == 1024
    watchdog.enough_files(512)
    assert limits["soft"] == 2 * 512 + 512 and capsys.readouterr().err == ""
    watchdog.enough_files(4096)
    assert limits["soft"] == 4096 and "raise it (ulimit -Hn" in capsys.readouterr().err
