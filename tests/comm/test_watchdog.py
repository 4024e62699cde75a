"""``comm/watchdog.py``: a peer is looked up by pid only in this process's own PID namespace. (The watchdog in
running jobs: tests/launched/test_faults.py.)"""
import os
import subprocess
import threading
import types

from deepspeed_xla.comm import watchdog


def _watchdog_seeing(process) -> "watchdog.Watchdog":
    dog = watchdog.Watchdog.__new__(watchdog.Watchdog)  # no store, no thread: only the peer check
    dog._processes = {1: process}
    dog._store = types.SimpleNamespace(check=lambda keys: False)  # rank 1 has not finished
    return dog


def test_a_dead_pid_counts_only_in_this_pid_namespace():
    """Containers on the host network and cloned VMs share the hostname; their pids are not ours."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    here = watchdog.pid_namespace()
    with open("/proc/sys/kernel/random/boot_id") as handle:
        assert here.startswith(handle.read().strip() + ":")
    assert "exited unexpectedly" in _watchdog_seeing((here, dead.pid, 0.0))._local_peer_gone(1)
    other_container = here.rsplit(":", 1)[0] + ":1"
    assert _watchdog_seeing((other_container, dead.pid, 0.0))._local_peer_gone(1) is None


class _NoStore:
    def __getattr__(self, name):
        raise AssertionError(f"the store was used ({name})")


def test_a_forked_child_ending_does_not_finish_the_rank():
    """DataLoader workers are forked from a rank and end with ``os._exit``: the rank itself has not finished."""
    dog = watchdog.Watchdog.__new__(watchdog.Watchdog)
    dog.pid = os.getpid() + 1  # what a forked child sees: the watchdog belongs to its parent
    dog._store = _NoStore()
    dog.finish()
    dog.exit_called(0)


class _FailureStore:
    """The failure key alone: ``compare_set`` keeps the first value, as the rendezvous store does."""

    def __init__(self):
        self.values = {}

    def compare_set(self, key, expected, value):
        self.values.setdefault(key, value)
        return self.values[key].encode()

    def set(self, key, value):
        self.values[key] = value


def _stopping_watchdog(monkeypatch, exits: list) -> "watchdog.Watchdog":
    dog = watchdog.Watchdog.__new__(watchdog.Watchdog)
    dog.rank, dog._store = 1, _FailureStore()
    dog._stopped_by, dog._stop_lock = None, threading.RLock()
    monkeypatch.setattr(watchdog, "_real_exit", exits.append)
    return dog


def test_a_rank_stops_once_when_a_second_thread_sees_the_failure(monkeypatch, capsys):
    """The main thread stops for a failed collective while the watchdog's thread reads the same failure in the store:
    one line, one exit; the second thread waits for the first to end the process."""
    exits = []
    dog = _stopping_watchdog(monkeypatch, exits)
    dog.stop_job("rank 0 raised RuntimeError: boom")
    second = threading.Thread(target=dog.stop_job, args=("rank 0 raised RuntimeError: boom", ), daemon=True)
    second.start()
    second.join(0.5)
    assert second.is_alive() and exits == [watchdog.EXIT_CODE]
    assert capsys.readouterr().err == "[deepspeed_xla] rank 1 stops: rank 0 raised RuntimeError: boom\n"


def test_a_signal_handler_inside_the_stop_lets_it_go_on(monkeypatch, capsys):
    """SIGTERM's handler runs on the main thread between bytecodes, possibly inside its own stop: it returns, and the
    interrupted stop is the one that prints and ends the process."""
    exits = []
    dog = _stopping_watchdog(monkeypatch, exits)
    publish = dog.publish
    monkeypatch.setattr(dog, "publish", lambda failure: (dog.stop_job("rank 1 got SIGTERM"), publish(failure))[1])
    dog.stop_job("rank 0 raised RuntimeError: boom")
    assert exits == [watchdog.EXIT_CODE]
    assert capsys.readouterr().err == "[deepspeed_xla] rank 1 stops: rank 0 raised RuntimeError: boom\n"


def test_peers_are_told_the_first_line_of_a_raised_error(capsys):
    """An XLA error can run to pages (a TPU's largest allocations after its status line): the peers print its first
    line, the raising rank's own traceback keeps the rest."""
    dog = watchdog.Watchdog.__new__(watchdog.Watchdog)
    dog.rank, dog._store = 1, _FailureStore()
    dog.publish_exception(RuntimeError, RuntimeError("\nRESOURCE_EXHAUSTED: out of memory\n\nLargest allocations:\n1."))
    assert dog._store.values[watchdog._FAILED] == "rank 1 raised RuntimeError: RESOURCE_EXHAUSTED: out of memory"
    assert capsys.readouterr().err == ""
