"""``comm/hang_report.py``: ranks that wait in different collectives, all alive, end at the collective timeout, and
every rank says which collective each rank waits in and which ranks never arrived.

Four ranks, tensor-parallel groups {0, 1} and {2, 3}: ranks 0 and 2 all-reduce on theirs while ranks 1 and 3 wait in a
barrier on the world, as AutoTP's input check and DeepSpeed's test harness did when the check raised on ranks 1 and 3
(the harness caught the error and went on to its closing barrier). Each rank catches a failed collective and goes on
to another, as the harness does: before the report, each rank's timeout only moved it to its next wait.
"""
import time

import pytest

from deepspeed_xla.comm.failure import EXIT_CODE
from deepspeed_xla.comm.hang_report import Wait, report
from tests.multiproc import run_ranks

WORLD = 4
TIMEOUT = 8  # seconds: DS_XLA_COMM_TIMEOUT of the run
HEARTBEAT = 10  # seconds: its heartbeat timeout; the watchdog publishes a wait after one interval, a tenth of it
# What the report says of the world's barrier, where ranks 1 and 3 wait.
BARRIER = ("[barrier on ranks 0, 1, 2, 3: waiting rank 1, 3; never arrived: rank 0, 2 (rank 0 waits in all_reduce(SUM) "
           "float32[4] on ranks 0, 1; rank 2 waits in all_reduce(SUM) float32[4] on ranks 2, 3)]")


def test_report_names_each_collective_and_the_ranks_that_never_arrived():
    waits = {0: Wait("all_reduce(SUM) float32[4]", (0, 1)), 1: Wait("barrier", (0, 1, 2, 3)),
             2: Wait("all_reduce(SUM) float32[4]", (2, 3)), 3: Wait("barrier", (0, 1, 2, 3))}
    text = report(waits, 2, 8.0, "DS_XLA_COMM_TIMEOUT")
    assert "rank 2's timed out after DS_XLA_COMM_TIMEOUT=8 s" in text
    assert BARRIER in text
    assert Wait.parse(str(waits[1])) == waits[1]


def rank_main() -> None:
    """One rank of the hang: warm both groups up, then wait where its peers do not."""
    import deepspeed
    import torch
    import deepspeed.comm as dist
    deepspeed.init_distributed()
    rank = dist.get_rank()
    tensor_parallel = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    tensor = torch.ones(4, device="xla")
    dist.all_reduce(tensor, group=tensor_parallel)
    dist.barrier()
    print(f"WAITING {time.time()}", flush=True)
    for _ in range(2):  # a harness that catches the error and goes on to another collective
        try:
            if rank % 2 == 0:
                dist.all_reduce(tensor, group=tensor_parallel)
            else:
                dist.barrier()
        except RuntimeError as error:
            print(f"CAUGHT {error}", flush=True)
    dist.barrier()


@pytest.fixture(scope="module")
def ranks():
    """Each rank's process and when it ended, against when it started waiting."""
    procs = run_ranks(f"{__name__}:rank_main", WORLD, timeout=120,
                      env={"DS_ACCELERATOR": "xla", "LOCAL_SIZE": WORLD, "CPU_NUM_DEVICES": WORLD,
                           "DS_XLA_COMM_TIMEOUT": TIMEOUT, "DS_XLA_HEARTBEAT_TIMEOUT": HEARTBEAT})
    return procs, time.time()


def test_the_job_ends_at_the_collective_timeout(ranks):
    """Every rank stops within the timeout and a few heartbeat intervals (the search for a dead rank, the others
    reading the failure): not after a second timeout, which a rank going on to its next collective would add."""
    procs, ended = ranks
    for rank, proc in enumerate(procs):
        assert proc.returncode == EXIT_CODE, f"rank {rank} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
        (waiting, ) = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("WAITING")]
        assert TIMEOUT <= ended - waiting < TIMEOUT + HEARTBEAT / 2, (rank, ended - waiting)
        assert "CAUGHT" not in proc.stdout, (rank, proc.stdout)


@pytest.mark.parametrize("rank", range(WORLD))
def test_every_rank_names_each_collective_and_who_never_arrived(ranks, rank):
    (stop, ) = [line for line in ranks[0][rank].stderr.splitlines() if line.startswith(f"[deepspeed_xla] rank {rank} "
                                                                                      f"stops: ")]
    assert "the ranks wait in different collectives, all alive" in stop and "after DS_XLA_COMM_TIMEOUT=8 s" in stop
    for first, second in ((0, 1), (2, 3)):
        assert (f"[all_reduce(SUM) float32[4] on ranks {first}, {second}: waiting rank {first}; never arrived: "
                f"rank {second} (rank {second} waits in barrier on ranks 0, 1, 2, 3)]") in stop, stop
    assert BARRIER in stop, stop
