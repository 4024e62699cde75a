"""A pod's control plane on one machine: N ranks' watchdogs (heartbeat thread, failure record) and checkpoint-on-
SIGTERM agreements against one rendezvous store, each rank a set of threads of this process with its own store
connections, as a rank process has; no training, no gloo. What it measures, for ``docs/tpu_pods.md``:

- the sockets rank 0's process serves (the store's server side);
- store operations per second, in steady training (every rank beating, and reading the SIGTERM target at each of
  its steps) and while rank 0 waits at exit for the others;
- the time from one rank going silent to the failure being published, and to every rank having stopped;
- the time from the last rank finishing to rank 0's exit.

    python -m tests.comm.pod_simulation 256 512      # from the repository root, in the venv
"""
import contextlib
import os
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Dict, List

import torch.distributed as dist

from deepspeed_xla.comm import failure, heartbeat, watchdog
from deepspeed_xla.comm.preemption import CheckpointOnSigterm
from deepspeed_xla.launch_env import free_port

HEARTBEAT = 5.0  # seconds: a tenth of it is the interval; ops/s scale with its inverse (60 s: a twelfth of these)
STEP = 1.0  # seconds between two optimizer steps of every rank


class Counted:
    """A store that counts the operations made through it (all the simulation's stores share one count)."""
    ops = 0
    lock = threading.Lock()

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def counted(*args, **kwargs):
            with Counted.lock:
                Counted.ops += 1
            return method(*args, **kwargs)

        return counted


def served_sockets(port: int) -> int:
    """Established TCP connections whose local port is the store's: the server side, in rank 0's process."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as handle:
            for line in list(handle)[1:]:
                local, state = line.split()[1], line.split()[3]
                count += state == "01" and int(local.rsplit(":", 1)[1], 16) == port
    return count


def _ops_per_second(seconds: float) -> float:
    before, began = Counted.ops, time.monotonic()
    time.sleep(seconds)
    return (Counted.ops - before) / (time.monotonic() - began)


class Pod:
    """``size`` ranks, each with the job's store connection, its watchdog and its checkpoint-on-SIGTERM side."""

    def __init__(self, size: int, workdir: str):
        self.size, self.port = size, free_port()
        self.server = dist.TCPStore("127.0.0.1", self.port, size, True, timeout=timedelta(seconds=120),
                                    wait_for_workers=False)
        self.exits: Dict[int, float] = {}
        self.dogs: List[heartbeat.Watchdog] = []
        for rank in range(size):
            job = self.server if rank == 0 else dist.TCPStore("127.0.0.1", self.port, size, False,
                                                              timeout=timedelta(seconds=120))
            dog = watchdog.build(job, rank, size, HEARTBEAT, 600.0, workdir)
            dog._store = dog.failures._store = Counted(dog._store)
            dog.checkpoint._store = Counted(dog.checkpoint._store)
            self.dogs.append(dog)
        self._stepping = threading.Event()

    def start(self) -> None:
        for dog in self.dogs:
            dog.start()
        threading.Thread(target=self._steps, daemon=True).start()

    def _steps(self) -> None:
        """Every rank's optimizer steps: each reads the SIGTERM target at its step's end."""
        step = 0
        while not self._stepping.wait(STEP):
            step += 1
            for dog in self.dogs:
                if not dog._stopping.is_set() and dog.rank not in self.exits:
                    dog.checkpoint.step_started(step - 1)
                    dog.checkpoint.step_ended(step)

    def exited(self, code: int) -> None:
        """``os._exit`` of a simulated rank: its thread ends instead."""
        rank = next(dog.rank for dog in self.dogs if dog._thread is threading.current_thread()) \
            if threading.current_thread() is not threading.main_thread() else -1
        self.exits[rank] = time.monotonic()
        raise SystemExit(code)

    def stop(self) -> None:
        self._stepping.set()
        for dog in self.dogs:
            dog._stopping.set()


def measure(size: int) -> dict:
    """One pod of ``size`` ranks: steady state; rank 0's script ends and it waits for the others; then one rank goes
    silent, and every rank stops."""
    figures = {"ranks": size, "heartbeat_timeout_s": HEARTBEAT}
    real_exit, real_stderr = failure._real_exit, sys.stderr
    sys.stderr = open(os.devnull, "w")  # every rank prints why it stops
    try:
        with tempfile.TemporaryDirectory() as workdir:
            began = time.monotonic()
            pod = Pod(size, workdir)
            failure._real_exit = pod.exited
            pod.start()
            figures["start_s"] = round(time.monotonic() - began, 2)
            figures["rank0_sockets"] = served_sockets(pod.port)
            interval = pod.dogs[0].interval
            figures["steady_ops_per_s"] = round(_ops_per_second(3 * interval))
            rank0 = threading.Thread(target=pod.dogs[0].finish)
            rank0.start()  # rank 0's script ended: it keeps the store up for the others
            time.sleep(interval)
            figures["rank0_exit_wait_ops_per_s"] = round(_ops_per_second(2 * interval))
            pod.dogs[size // 2]._stopping.set()  # a rank goes silent
            silenced = time.monotonic()
            while pod.dogs[0].failures.published() is None and time.monotonic() < silenced + 10 * HEARTBEAT:
                time.sleep(0.01)
            figures["detect_s"] = round(time.monotonic() - silenced, 2)
            while len(pod.exits) < size - 2 and time.monotonic() < silenced + 20 * HEARTBEAT:
                time.sleep(0.01)
            last = max(pod.exits.values(), default=silenced)
            figures["all_stopped_s"] = round(last - silenced, 2)
            figures["stopped"] = len(pod.exits)
            rank0.join()
            figures["rank0_exit_after_last_s"] = round(time.monotonic() - last, 2)
            pod.stop()
    finally:
        failure._real_exit, sys.stderr = real_exit, real_stderr
    return figures


if __name__ == "__main__":
    for ranks in map(int, sys.argv[1:] or ["256", "512"]):
        print(measure(ranks), flush=True)
