"""``comm/watchdog.py``: a peer is looked up by pid only in this process's own PID namespace. (The watchdog in
running jobs: tests/launched/test_faults.py.)"""
import os
import subprocess
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
