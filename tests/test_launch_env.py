"""Where a process sits, from whichever launcher started it; plain python as rank 0 of 1."""
import pytest

from deepspeed_xla.launch_env import ProcessLayout, fill_single_process_env, process_layout


@pytest.mark.parametrize("env, expected", [
    ({"LOCAL_RANK": "1", "LOCAL_SIZE": "4", "CROSS_RANK": "2"}, ProcessLayout(1, 4, 2)),
    ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "1"}, ProcessLayout(3, 8, 1)),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, ProcessLayout(2, 4, 0)),
    ({"MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_LOCAL_SIZE": "2"}, ProcessLayout(1, 2, 0)),
    ({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, ProcessLayout(0, 2, 0)),
    ({"SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODEID": "5"}, ProcessLayout(3, 4, 5)),
    ({"SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2),2", "SLURM_NODEID": "7", "SLURM_STEP_NODEID": "2"},
     ProcessLayout(1, 2, 2)),
    ({}, ProcessLayout(0, 1, 0)),
], ids=["deepspeed", "torchrun", "openmpi", "mvapich", "intel-mpi", "slurm", "slurm-without-ntasks-per-node",
        "plain-python"])
def test_process_layout_from_each_launcher(env, expected):
    assert process_layout(env) == expected


def test_plain_python_becomes_rank_0_of_1():
    env = {}
    assert fill_single_process_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("0", "1", "0", "127.0.0.1")
    assert 0 < int(env["MASTER_PORT"]) < 65536


@pytest.mark.parametrize("env", [{"RANK": "1"}, {"OMPI_COMM_WORLD_SIZE": "4"}, {"SLURM_NTASKS": "2"}])
def test_launched_or_mpi_processes_are_left_alone(env):
    before = dict(env)
    assert not fill_single_process_env(env)
    assert env == before
