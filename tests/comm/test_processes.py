"""``comm/processes.py``: a same-host peer is gone when its pid no longer runs the process that registered, judged by
the start tick, which no wall-clock step moves; and only in this PID namespace."""
import os
import subprocess
import time

import psutil
import psutil._pslinux
import pytest

from deepspeed_xla.comm import processes


@pytest.fixture
def peer():
    """A live process of this host, as a peer rank is."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def _registered(pid: int) -> processes.Registered:
    return processes.parse(processes.registration(pid))


def test_a_live_peer_is_not_gone_even_after_a_wall_clock_step(peer, monkeypatch):
    """NTP or chrony stepping the clock, ``date -s`` or a resumed VM move the boot time that every start *time* is
    computed from (psutil's ``create_time``): a peer registered before the step is the same process after it."""
    registered = _registered(peer.pid)
    assert not processes.ended_here(registered)
    stepped = time.time() + 3600.0
    boot_time = psutil._pslinux.boot_time() + 3600.0
    monkeypatch.setattr(time, "time", lambda: stepped)
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: boot_time)
    assert psutil.Process(peer.pid).create_time() > time.time() - 60  # the step reached psutil's start time
    assert not processes.ended_here(registered)
    assert _registered(peer.pid) == registered


def test_a_dead_pid_a_zombie_and_a_reused_pid_are_gone(peer):
    registered = _registered(peer.pid)
    assert not processes.ended_here(registered._replace(tick=registered.tick))
    assert processes.ended_here(registered._replace(tick=registered.tick - 1))  # the pid now runs another process
    peer.kill()
    os.waitid(os.P_PID, peer.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert processes.ended_here(registered)
    peer.wait()
    assert processes.ended_here(registered)


def test_a_pid_counts_only_in_this_pid_namespace(peer):
    """Containers on the host network and cloned VMs share the hostname; their pids are not ours."""
    here = processes.pid_namespace()
    with open("/proc/sys/kernel/random/boot_id") as handle:
        assert here.startswith(handle.read().strip() + ":")
    other_container = _registered(peer.pid)._replace(namespace=here.rsplit(":", 1)[0] + ":1")
    peer.kill()
    peer.wait()
    assert processes.ended_here(other_container._replace(namespace=here))
    assert not processes.ended_here(other_container)


def test_a_command_with_spaces_and_parentheses_is_read_past(tmp_path):
    """``/proc/<pid>/stat`` puts the command in parentheses, and a command may hold both."""
    odd = tmp_path / "a) b (c"
    odd.write_bytes(open("/bin/sleep", "rb").read())
    odd.chmod(0o755)
    proc = subprocess.Popen([str(odd), "60"])
    try:
        parsed = psutil._pslinux.Process(proc.pid)._parse_stat_file()  # psutil's own reading of the same fields
        assert parsed["name"] == b"a) b (c" and processes.start_tick(proc.pid) == int(parsed["create_time"])
    finally:
        proc.kill()
        proc.wait()


def test_a_malformed_registration_raises():
    assert processes.parse("") is None
    for malformed in ("garbage", "ns 12", "ns twelve 3"):
        with pytest.raises(ValueError):
            processes.parse(malformed)
