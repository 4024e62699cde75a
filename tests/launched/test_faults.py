"""A rank that dies, raises or goes silent ends the job within the comm timeout, naming that rank.

Two views: ranks joined without a launcher (as on other hosts of a multi-host job, where no local
launcher stops them), where the surviving rank must find out by itself; and the ``deepspeed`` CLI
with one rank killed mid-training, whose exit code must say the job failed.
"""
import os
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch

from deepspeed_xla.comm.watchdog import TIMEOUT_ENV, comm_timeout
from tests.multiproc import ds_config, kill_group, start_command, start_ranks, training_command

TIMEOUT = 6  # DS_XLA_COMM_TIMEOUT for the ranks without a launcher, seconds
# For the launched job: the ranks find a dead local peer at once, but tearing down the launcher and
# the runner takes seconds on a loaded 2-core machine.
LAUNCHED_TIMEOUT = 30
FAULT_ENV = "DSX_TEST_FAULT"


def _raise():
    raise ValueError("injected fault")


FAULTS = {
    "kill": lambda: os.kill(os.getpid(), signal.SIGKILL),  # killed, or out of host memory
    "stop": lambda: os.kill(os.getpid(), signal.SIGSTOP),  # alive but silent: a lost host
    "raise": _raise,
}


def collective_loop() -> None:
    """A rank: all-reduce an XLA tensor in a loop; after a few, rank 1 fails as ``DSX_TEST_FAULT`` says."""
    import deepspeed
    import torch.distributed as dist
    device = deepspeed.get_accelerator().current_device_name()  # XLA starts before the timeout applies
    deepspeed.init_distributed()
    rank = dist.get_rank()
    for step in range(100000):
        dist.all_reduce(torch.ones(4, device=device))
        if rank == 1 and step == 3:
            print(f"FAULT {time.time()}", flush=True)
            FAULTS[os.environ[FAULT_ENV]]()
    raise AssertionError(f"rank {rank} kept running after its peer's fault")


def test_comm_timeout_is_seconds_and_names_the_variable_when_wrong(monkeypatch):
    default = timedelta(minutes=10)
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert comm_timeout(default) == default
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert comm_timeout(default) == timedelta(seconds=2.5)
    for wrong in ("soon", "0", "-3"):
        monkeypatch.setenv(TIMEOUT_ENV, wrong)
        with pytest.raises(ValueError, match=f"{TIMEOUT_ENV}=.*number of seconds"):
            comm_timeout(default)


def _output(files) -> str:
    out, err = files
    out.seek(0)
    err.seek(0)
    return out.read() + err.read()


@pytest.fixture(scope="module")
def faulted_jobs():
    """Every fault at once, one 2-rank job each: {fault: (rank 0 exit code, seconds after the fault, output)}."""
    jobs = {fault: start_ranks(f"{__name__}:collective_loop", 2,
                               {"DS_ACCELERATOR": "xla", "DS_XLA_COMM_TIMEOUT": TIMEOUT, FAULT_ENV: fault})
            for fault in FAULTS}
    results = {}
    try:
        for fault, (procs, logs) in jobs.items():
            try:
                procs[0].wait(timeout=180)
            except subprocess.TimeoutExpired:
                pass
            ended = time.time()
            faulted = [line for line in _output(logs[1]).splitlines() if line.startswith("FAULT ")]
            delay = ended - float(faulted[0].split()[1]) if faulted else None
            results[fault] = (procs[0].returncode, delay, _output(logs[0]) + _output(logs[1]))
    finally:
        for procs, _ in jobs.values():
            for proc in procs:
                kill_group(proc)
    return results


@pytest.mark.parametrize("fault, named", [
    ("kill", "rank 1 (pid"),
    ("stop", "rank 1 sent no heartbeat for 6 s"),
    ("raise", "rank 1 raised ValueError: injected fault"),
])
def test_survivor_exits_naming_the_failed_rank(faulted_jobs, fault, named):
    code, delay, output = faulted_jobs[fault]
    assert code not in (0, None), f"rank 0 did not fail ({code}):\n{output[-6000:]}"
    assert delay is not None and delay < TIMEOUT + 4, f"rank 0 ended {delay} s after the fault:\n{output[-6000:]}"
    assert f"[deepspeed_xla] rank 0 stops: {named}" in output, output[-6000:]


def _worker(launcher: psutil.Process, local_rank: int) -> psutil.Process:
    for child in launcher.children(recursive=True):
        if f"--local_rank={local_rank}" in child.cmdline():
            return child
    raise AssertionError(f"no worker with --local_rank={local_rank} under the launcher")


def test_killing_a_rank_mid_training_fails_the_job(tmp_path: Path):
    cmd, env, _ = training_command(tmp_path, "xla", ds_config(2), num_procs=2, steps=100000,
                                   extra_env={"DS_XLA_COMM_TIMEOUT": LAUNCHED_TIMEOUT})
    log = tmp_path / "job.log"
    with open(log, "w") as handle:
        job = start_command(cmd, cwd=tmp_path, env=env, stdout=handle, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while "step    0" not in log.read_text():  # rank 0 finished a step: both ranks are training
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-6000:]
            time.sleep(0.2)
        _worker(psutil.Process(job.pid), 1).kill()
        killed = time.monotonic()
        code = job.wait(timeout=LAUNCHED_TIMEOUT + 60)
        took = time.monotonic() - killed
    finally:
        kill_group(job)  # the runner, its launcher and both workers, whatever state they are in
    assert code != 0, log.read_text()[-6000:]
    assert took < LAUNCHED_TIMEOUT, f"the job ended {took:.1f} s after rank 1 was killed:\n{log.read_text()[-6000:]}"
