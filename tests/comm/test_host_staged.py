"""The ``xla_host`` backend on two PJRT CPU processes: every collective, on real XLA tensors; and the reductions on
three, where gloo reduces in place (two ranks swap operands instead).

One 2-rank launch runs all checks in order (importing torch_xla costs seconds per process). Each rank
prints ``PASS <check>`` after a check; the first failure ends that rank with its traceback, and its
peer then fails on the next collective (or the group's 60 s timeout), so a broken check cannot hang
the run; ``test_collective[<check>]`` names the first check that failed.
"""
import pytest
import torch.distributed as dist

from deepspeed_xla.comm import backends, staging
from deepspeed_xla.comm.gloo_output import VERBOSE_ENV
from tests.comm.host_staged_checks import TIMEOUT, WORLD, in_place_reductions
from tests.comm.host_staged_flow_checks import CHECKS
from tests.multiproc import run_ranks

STAGING = {"zero-copy": True, "copies": False}  # PJRT CPU's path, and the TPU side channel's


def rank_main() -> None:
    """One rank: join the ``xla_host`` world and run every check in order, for each way of staging."""
    dist.init_process_group(backends.register_backend("xla_host", host_addressable=True), timeout=TIMEOUT)
    rank = dist.get_rank()
    for name, zero_copy in STAGING.items():
        staging.configure(zero_copy)
        for fn in CHECKS:
            fn(rank)
            print(f"PASS {name} {fn.__name__}", flush=True)
    dist.destroy_process_group()


def three_rank_main() -> None:
    """One of three ranks: the in-place reductions, for each way of staging."""
    dist.init_process_group(backends.register_backend("xla_host", host_addressable=True), timeout=TIMEOUT)
    for name, zero_copy in STAGING.items():
        staging.configure(zero_copy)
        in_place_reductions(dist.get_rank())
        print(f"PASS {name} in_place_reductions", flush=True)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(f"{__name__}:rank_main", WORLD)


@pytest.fixture(scope="module")
def three_ranks():
    """With ``DS_XLA_VERBOSE=1`` (read by the ranks alone: the fork server is shared)."""
    return run_ranks(f"{__name__}:three_rank_main", 3, env={VERBOSE_ENV: "1"}, after_import=(VERBOSE_ENV,))


@pytest.mark.parametrize("name", [fn.__name__ for fn in CHECKS])
@pytest.mark.parametrize("staging", list(STAGING))
def test_collective(ranks, staging, name):
    for rank, proc in enumerate(ranks):
        if f"PASS {staging} {name}" not in proc.stdout.splitlines():
            pytest.fail(f"rank {rank} (exit code {proc.returncode}) did not pass {name} ({staging}):\n"
                        f"{proc.stderr[-6000:]}")


@pytest.mark.parametrize("staging", list(STAGING))
def test_reductions_of_three_ranks_in_place(three_ranks, staging):
    for rank, proc in enumerate(three_ranks):
        assert f"PASS {staging} in_place_reductions" in proc.stdout.splitlines(), (
            f"rank {rank} (exit code {proc.returncode}):\n{proc.stderr[-6000:]}")
    assert [proc.returncode for proc in three_ranks] == [0, 0, 0]


def test_gloo_lines_held_back_unless_verbose_then_whole_by_rank(ranks, three_ranks):
    """gloo prints its line to std::cout when a group connects (``comm/gloo_output``)."""
    assert not [line for proc in ranks for line in proc.stdout.splitlines() if "[Gloo]" in line]
    for rank, proc in enumerate(three_ranks):
        gloo = [line for line in proc.stdout.splitlines() if "[Gloo]" in line]
        assert gloo == [f"[rank {rank}] [Gloo] Rank {rank} is connected to 2 peer ranks. Expected number of connected "
                        "peer ranks is : 2"], proc.stdout


def test_ranks_exit_cleanly(ranks):
    for rank, proc in enumerate(ranks):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{proc.stderr[-6000:]}"
