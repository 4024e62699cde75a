"""Same-host peers by pid: whether the process a rank registered is still running under its pid.

A pid is reused once its process is reaped, so a rank registers its pid with the process's start tick: the clock
ticks from boot to its start (``/proc/<pid>/stat`` field 22). A start *time* (psutil's ``create_time``: that tick
plus the boot time) moves whenever the wall clock is stepped (NTP or chrony, ``date -s``, a VM resumed), and every
rank would then find its healthy neighbour "exited"; the tick never changes. A pid is looked up only where it means
the same process: the same kernel boot and PID namespace (``pid_namespace``). Linux only: elsewhere no peer is
looked up by pid, and the heartbeat alone finds a dead one.
"""
import functools
import os
from typing import NamedTuple, Optional

_STARTTIME = 22 - 3  # field 22, counted from field 3 (the state), the first after the command's closing parenthesis
_ENDED = (b"Z", b"X")  # a zombie its parent has not reaped yet, or a process being torn down


class Registered(NamedTuple):
    """What a rank publishes about its own process (``registration``)."""
    namespace: str
    pid: int
    tick: int


@functools.lru_cache(maxsize=None)
def pid_namespace() -> Optional[str]:
    """Where this process's pid means this process: the kernel's boot id and the PID namespace. A hostname is not
    enough: containers on the host network and cloned VMs share it, and their pids are not ours to look up."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot_id = handle.read().strip()
        namespace = os.stat("/proc/self/ns/pid")
    except OSError:  # not Linux
        return None
    return f"{boot_id}:{namespace.st_dev}:{namespace.st_ino}"


def start_tick(pid: int) -> Optional[int]:
    """Clock ticks from boot to the start of running process ``pid``; None once it has ended."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # the command, in parentheses, may hold spaces and parentheses
    return None if fields[0] in _ENDED else int(fields[_STARTTIME])


def registration(pid: int) -> str:
    """The value a rank publishes for process ``pid`` (its own); empty where pids are not looked up."""
    namespace = pid_namespace()
    return "" if namespace is None else f"{namespace} {pid} {start_tick(pid)}"


def parse(value: str) -> Optional[Registered]:
    """A published registration; None for an empty one. Raises ValueError on anything else."""
    if not value:
        return None
    namespace, pid, tick = value.split()
    return Registered(namespace, int(pid), int(tick))


def ended_here(registered: Registered) -> bool:
    """Whether the registered process ran in this process's PID namespace and is gone (its pid free, a zombie, or
    reused by a process that started at another tick)."""
    return registered.namespace == pid_namespace() and start_tick(registered.pid) != registered.tick
