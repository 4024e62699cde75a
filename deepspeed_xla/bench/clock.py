"""A timed training loop's clocks, per step: the step's wall and CPU time, its tracing time, the device's execute
time, and when the first step ended (``scripts/train.py --timings`` and the floor use them)."""
import os
import time
from typing import Callable, Dict, List, Optional, Tuple

KEYS = ("step_times", "trace_times", "step_cpu_times", "execute_times")
DeviceClock = Callable[[], Tuple[float, Optional[float]]]


class StepClock:
    """``start()`` at a step's start, ``traced()`` when the host has done its part of the step (before waiting for
    the device), ``end()`` when the device has finished the step.

    The tracing time runs from the step's start until its graph is handed to the runtime. On XLA that is when the
    step's last graph execution started, from ``device_clock`` (``xla_runtime.execution_clock``: torch_xla's
    ``ExecuteTime`` samples): the sync that cuts the graph may return only when the execution has ended (PJRT CPU
    does so when the graph donates its parameters' buffers), so timing the sync's return would count the execution.
    Elsewhere it ends at ``traced()``. The execute time is the sum of the step's executions; the CPU time is the
    whole process's, all threads (torch runs XLA's backward on an autograd thread, PJRT CPU the graph on its own)."""

    def __init__(self, device_clock: Optional[DeviceClock] = None):
        self.device_clock = device_clock
        self.times: Dict[str, List[Optional[float]]] = {key: [] for key in KEYS}
        self.first_step: Dict[str, float] = {}
        self.executed = self.started = self.wall = self.cpu = self.host = 0.0

    def start(self) -> None:
        self.executed = self.device_clock()[0] if self.device_clock else 0.0
        self.started, self.wall, self.cpu = time.time(), time.perf_counter(), time.process_time()

    def traced(self) -> None:
        self.host = time.perf_counter() - self.wall

    def end(self) -> None:
        wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        trace, executed = self.host, None
        if self.device_clock:
            total, last_start = self.device_clock()
            executed = total - self.executed
            trace = last_start - self.started if executed and last_start is not None else None
        for key, value in zip(KEYS, (wall, trace, cpu, executed)):
            self.times[key].append(value)
        if not self.first_step:
            self.first_step = {"first_step_end": time.time(), "process_start": process_start(),
                               "first_step_cpu": time.process_time()}

    def results(self) -> dict:
        """The per-step lists; when the first step ended and the process started (``time.time()``'s clock), and
        the process's CPU seconds by then."""
        return {**self.times, **self.first_step}


def process_start() -> float:
    """When this process started, on ``time.time()``'s clock: Linux counts it in clock ticks since boot (10 ms;
    psutil adds the boot time in whole seconds instead, which would put it up to a second off)."""
    with open("/proc/self/stat") as stat:
        ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime; the name may hold spaces
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
