"""A rank that dies, raises, goes silent or ends early ends the job within the heartbeat timeout, naming that rank,
however long the collective timeout is.

The ranks join without a launcher (as on other hosts of a multi-host job, where no local launcher stops them):
the surviving rank must find out by itself. Through the ``deepspeed`` CLI, with one runner per node
(``--no_ssh``): ``tests/launched/test_launchers.py``.
"""
import os
import signal
import sys
import threading
import time

import pytest
import torch

from deepspeed_xla.comm.preemption import SAVE_DIR_ENV
from deepspeed_xla.comm.timeouts import HEARTBEAT_ENV, TIMEOUT_ENV
from deepspeed_xla.comm.watchdog import TERMINATED_EXIT_CODE
from tests.multiproc import kill_group, start_ranks

TIMEOUT = 6  # DS_XLA_HEARTBEAT_TIMEOUT of the faulted ranks, seconds
COLLECTIVE_TIMEOUT = 600  # DS_XLA_COMM_TIMEOUT of the faulted ranks: far above the time a failure may take to be seen
FAULT_ENV = "DSX_TEST_FAULT"  # "<fault>:<rank>"


class _EndsHere(Exception):
    """The faulting rank's script returns: uneven data, or early stopping on one rank."""


def _raise():
    raise ValueError("injected fault")


def _end():
    raise _EndsHere


def _sigterm_in_a_collective():
    """SIGTERM arrives while this rank waits in a collective that its peer never joins: only the watchdog's
    thread can act on it (Python runs the handler when the main thread runs Python again)."""
    import torch.distributed as dist
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    dist.barrier()


def _fork_a_child_then_sigterm():
    """Fork a child, as a DataLoader worker is, and stop it with SIGTERM, as the DataLoader's shutdown does: the
    child ends by its default action, with none of the rank's SIGTERM machinery, and the rank has published nothing.
    Then this rank gets SIGTERM itself: its handler, still installed, tells the peer."""
    from deepspeed_xla.comm import watchdog
    report_read, report = os.pipe()
    child = os.fork()
    if child == 0:
        sigterm = watchdog._watchdog.sigterm
        inherited = [fd for fd in (sigterm.read, sigterm.write) if _is_open(fd)]
        os.write(report, repr([signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, inherited]).encode())
        threading.Event().wait()
    os.close(report)
    state = os.read(report_read, 1000).decode()
    os.kill(child, signal.SIGTERM)
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    print(f"CHILD {state} ENDED BY SIGNAL {code}; PUBLISHED {watchdog._watchdog.published_failure()}", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


FAULTS = {
    "kill": lambda: os.kill(os.getpid(), signal.SIGKILL),  # killed, or out of host memory
    "stop": lambda: os.kill(os.getpid(), signal.SIGSTOP),  # alive but silent: a lost host
    "raise": _raise,
    "end": _end,
    "exit1": lambda: sys.exit(1),  # how frameworks end a failed run: no traceback, no excepthook
    "os_exit0": lambda: os._exit(0),
    "sigterm": lambda: os.kill(os.getpid(), signal.SIGTERM),  # a preempted spot VM, a TPU maintenance event
    "sigterm_in_collective": _sigterm_in_a_collective,
    "sigterm_no_step": lambda: os.kill(os.getpid(), signal.SIGTERM),  # a checkpoint asked for, and no step comes
    "fork_then_sigterm": _fork_a_child_then_sigterm,
}
#: (fault, faulting rank) -> what the other rank says when it stops.
FAULTED = {
    ("kill", 1): "rank 1 (pid",
    ("stop", 1): "rank 1 sent no heartbeat for 6 s",
    ("raise", 1): "rank 1 raised ValueError: injected fault",
    ("end", 1): "rank 1 ended while rank 0 waits in a collective",
    ("end", 0): "rank 0 ended while rank 1 waits in a collective",
    ("exit1", 1): "rank 1 ended while rank 0 waits in a collective",
    ("os_exit0", 1): "rank 1 ended while rank 0 waits in a collective",
    ("sigterm", 1): "rank 1 got SIGTERM: preempted",
    ("kill", 0): "lost the rendezvous store on rank 0",  # rank 0's host lost: the store goes with it
    ("sigterm", 0): "rank 0 got SIGTERM: preempted",  # the rank that holds the rendezvous store
    ("sigterm_in_collective", 1): "rank 1 got SIGTERM: preempted",
    ("sigterm_no_step", 1): (f"rank 1 got SIGTERM: preempted (a spot VM, a TPU maintenance event), or stopped by "
                             f"its scheduler or launcher; no optimizer step ended for {HEARTBEAT_ENV}={TIMEOUT} s "
                             "after it"),
    ("fork_then_sigterm", 1): "rank 1 got SIGTERM: preempted",
}
#: Faults whose ranks run with a checkpoint on SIGTERM asked for (``DS_XLA_CHECKPOINT_ON_SIGTERM``).
CHECKPOINTED = {"sigterm_no_step"}


def _join() -> tuple:
    """This rank's XLA device name and rank, after ``deepspeed.init_distributed``."""
    import deepspeed
    import torch.distributed as dist
    device = deepspeed.get_accelerator().current_device_name()  # XLA starts before the timeout applies
    deepspeed.init_distributed()
    return device, dist.get_rank()


def collective_loop() -> None:
    """A rank: all-reduce an XLA tensor in a loop; after a few, one rank fails as ``DSX_TEST_FAULT`` says."""
    import torch.distributed as dist
    device, rank = _join()
    fault, faulting = os.environ[FAULT_ENV].split(":")
    for step in range(100000):
        dist.all_reduce(torch.ones(4, device=device))
        if rank == int(faulting) and step == 3:
            print(f"FAULT {time.time()}", flush=True)
            try:
                FAULTS[fault]()
            except _EndsHere:
                return
    raise AssertionError(f"rank {rank} kept running after its peer's fault")


def last_rank_saves_alone() -> None:
    """Both ranks train, then rank 1 ends with ``os._exit(0)`` while rank 0 is still writing (no collective): rank 0
    finishes once its watchdog has seen rank 1's process gone, and run its check twice since."""
    import torch.distributed as dist
    from deepspeed_xla.comm import processes, watchdog
    device, rank = _join()
    for _ in range(4):
        dist.all_reduce(torch.ones(4, device=device))
    if rank == 1:
        os._exit(0)
    dog = watchdog._watchdog
    peer = dog._process(1)
    _until(lambda: processes.ended_here(peer), "rank 1's process did not end")
    beats = dog._store.add("beat/0", 0)
    _until(lambda: dog._store.add("beat/0", 0) >= beats + 2, "rank 0's watchdog stopped")
    print("RANK 0 SAVED", flush=True)


def _until(condition, what: str) -> None:
    """Poll ``condition`` for at most a minute (a bound, not a pace)."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def slow_first_compilation() -> None:
    """Rank 1 reaches the first collective long after rank 0, as after a first compilation longer than the comm
    timeout (a sleep here: like XLA compiling, it leaves the heartbeat thread running)."""
    import torch.distributed as dist
    device, rank = _join()
    if rank == 1:
        time.sleep(3 * float(os.environ[TIMEOUT_ENV]))
    dist.all_reduce(torch.ones(4, device=device))


def _output(files) -> str:
    """A rank's stdout and stderr, without the C++ stack frames of c10d's warnings."""
    out, err = files
    out.seek(0)
    err.seek(0)
    return "".join(line for line in (out.read() + err.read()).splitlines(keepends=True) if "frame #" not in line)


def _run_two_ranks(function: str, timeout: float, heartbeat: float) -> tuple:
    """Both ranks' exit codes and their output, ``function`` of this module run as 2 ranks without a launcher, with
    these collective and heartbeat timeouts."""
    env = {"DS_ACCELERATOR": "xla", TIMEOUT_ENV: timeout, HEARTBEAT_ENV: heartbeat}
    procs, logs = start_ranks(f"{__name__}:{function}", 2, env, (HEARTBEAT_ENV, ))
    try:
        codes = [proc.wait(timeout=180) for proc in procs]
    finally:
        for proc in procs:
            kill_group(proc)
    return codes, _output(logs[0]) + _output(logs[1])


@pytest.fixture(scope="module")
def faulted_jobs(tmp_path_factory):
    """Every fault at once, one 2-rank job each: {(fault, rank): (the other rank's exit code, seconds from
    this job's fault to that exit, output, the faulting rank's exit code)}. Jobs are polled together, so each is
    timed from its own fault."""
    def env(fault: str, rank: int) -> dict:
        saving = {SAVE_DIR_ENV: tmp_path_factory.mktemp("preempted")} if fault in CHECKPOINTED else {}
        return {"DS_ACCELERATOR": "xla", TIMEOUT_ENV: COLLECTIVE_TIMEOUT, HEARTBEAT_ENV: TIMEOUT,
                FAULT_ENV: f"{fault}:{rank}", **saving}

    jobs = {key: start_ranks(f"{__name__}:collective_loop", 2, env(*key), (FAULT_ENV, HEARTBEAT_ENV, SAVE_DIR_ENV))
            for key in FAULTED}
    ended = {}
    try:
        deadline = time.monotonic() + 180
        while len(ended) < len(jobs) and time.monotonic() < deadline:
            for (fault, rank), (procs, _) in jobs.items():
                if (fault, rank) not in ended and procs[1 - rank].poll() is not None:
                    ended[fault, rank] = time.time()
            time.sleep(0.1)
    finally:
        for procs, _ in jobs.values():
            for proc in procs:
                kill_group(proc)
    results = {}
    for (fault, rank), (procs, logs) in jobs.items():
        faulted = [line for line in _output(logs[rank]).splitlines() if line.startswith("FAULT ")]
        delay = ended[fault, rank] - float(faulted[0].split()[1]) if faulted and (fault, rank) in ended else None
        results[fault, rank] = (procs[1 - rank].returncode, delay, _output(logs[0]) + _output(logs[1]),
                                procs[rank].returncode)
    return results


@pytest.mark.parametrize("fault, rank", FAULTED, ids=[f"{fault}-rank{rank}" for fault, rank in FAULTED])
def test_survivor_exits_naming_the_failed_rank(faulted_jobs, fault, rank):
    code, delay, output, faulting_code = faulted_jobs[fault, rank]
    survivor = 1 - rank
    assert code not in (0, None), f"rank {survivor} did not fail ({code}):\n{output[-6000:]}"
    assert delay is not None and delay < TIMEOUT + 4, (
        f"rank {survivor} ended {delay} s after the fault:\n{output[-6000:]}")
    assert f"[deepspeed_xla] rank {survivor} stops: {FAULTED[fault, rank]}" in output, output[-6000:]
    if fault.startswith("sigterm"):  # it ends as SIGTERM would have, at once, even from inside a collective
        assert faulting_code == TERMINATED_EXIT_CODE, (faulting_code, output[-6000:])


def test_a_forked_child_stopped_by_sigterm_is_not_the_rank(faulted_jobs):
    """The child had SIGTERM's default action and none of the rank's pipe, and its end published nothing; the
    rank's own SIGTERM afterwards still reached its handler (the rest: ``fork_then_sigterm`` above)."""
    output = faulted_jobs["fork_then_sigterm", 1][2]
    assert f"CHILD [True, []] ENDED BY SIGNAL {-signal.SIGTERM}; PUBLISHED None" in output, output[-6000:]


def test_a_timeout_shorter_than_the_first_compilation_names_the_slow_rank_and_the_variable():
    """After gloo's timeout the search for a failed rank ends as soon as every peer has beaten: the slow rank is
    named alive long before it joins."""
    codes, output = _run_two_ranks("slow_first_compilation", timeout=3, heartbeat=2)
    assert 0 not in codes, f"{codes}\n{output[-6000:]}"
    slow = (f"rank 0 raised RuntimeError: rank 1 did not join the collective that rank 0 waited in for "
            f"{TIMEOUT_ENV}=3 s, and is alive: still compiling or computing")
    assert f"[deepspeed_xla] rank 1 stops: {slow}" in output, output[-6000:]
    assert f"set {TIMEOUT_ENV} (seconds) or DeepSpeed's timeout above the longest one" in output, output[-6000:]


def test_a_rank_that_ends_with_os_exit_lets_its_peer_finish_saving():
    """torch_xla scripts often end with ``os._exit(0)``: that is an end, not a crash, for a peer still writing."""
    codes, output = _run_two_ranks("last_rank_saves_alone", timeout=COLLECTIVE_TIMEOUT, heartbeat=2)
    assert codes == [0, 0] and "RANK 0 SAVED" in output, f"{codes}\n{output[-6000:]}"
