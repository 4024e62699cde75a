"""Where a process sits, from whichever launcher started it; plain python as rank 0 of 1."""
import subprocess

import pytest

from deepspeed_xla.launch_env import (ProcessLayout, expand_slurm_hostlist, fill_scheduler_env, fill_single_process_env,
                                      first_slurm_host, process_layout, slurm_master_port)


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


@pytest.mark.parametrize("env, expected", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
     ("3", "4", "1", "10.0.0.1", "29500")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
      "SLURM_STEP_NODELIST": "tpu-[03-04]", "SLURM_JOB_NODELIST": "tpu-[01-04]", "SLURM_JOB_ID": "123456"},
     ("5", "8", "1", "tpu-03", str(15000 + 123456 * 7919 % 10000))),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2",
      "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "7", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"},
     ("1", "2", "1", "127.0.0.1", "1234")),
], ids=["openmpi-from-the-runner", "srun-alone", "srun-with-the-address-given"])
def test_mpi_and_slurm_ranks_fill_deepspeeds_variables(env, expected):
    assert fill_scheduler_env(env)
    assert tuple(env[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")) == expected


@pytest.mark.parametrize("env", [
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},  # mpirun python train.py: DeepSpeed asks mpi4py
    {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "1",
     "SLURM_JOB_NODELIST": "a"},  # deepspeed's own launcher inside a Slurm allocation
    {},
], ids=["mpi-without-an-address", "launcher-inside-slurm", "no-launcher"])
def test_mpi_and_slurm_fill_leaves_the_rest_alone(env):
    before = dict(env)
    assert not fill_scheduler_env(env)
    assert env == before


@pytest.mark.parametrize("nodelist, first", [("localhost", "localhost"), ("tpu-[03-05,9],gpu1", "tpu-03"),
                                             ("n[7]x,m1", "n7x"), ("a,b[1-2]", "a"),
                                             ("rack[1-2]-node[01-04]", "rack1-node01"), ("x[08-11],y", "x08")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory):
    """Slurm's own expansion of a host list (``scontrol show hostnames``, which reads only a config file)."""
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\nPartitionName=p Nodes=ALL\n")

    def hostnames(nodelist: str):
        return subprocess.run(["scontrol", "show", "hostnames", nodelist], env={"SLURM_CONF": str(conf)},
                              capture_output=True, text=True, check=True).stdout.split()

    return hostnames


@pytest.mark.parametrize("nodelist", ["rack[1-2]-node[01-04]", "tpu-[03-05,9],gpu1", "a,b[1-2]", "x[8-11]",
                                      "r[1-2]n[1-2],s[09-10]", "x[1-3,5-6],y[098-101]"])
def test_slurm_hostlists_expand_as_slurm_expands_them(nodelist, scontrol):
    """Several bracket groups, commas inside and between them, ranges that keep their zero padding."""
    assert list(expand_slurm_hostlist(nodelist)) == scontrol(nodelist)


@pytest.mark.parametrize("nodelist, problem", [("x[1-", "has an unclosed '\\['"), ("x[3-1]", "the range '3-1'"),
                                               ("x[a]", "the range 'a'"), ("x]1[", "unbalanced brackets"),
                                               (",", "names no host")])
def test_a_hostlist_that_cannot_be_read_names_the_fix(nodelist, problem):
    with pytest.raises(ValueError, match=rf"{problem}.*set MASTER_ADDR"):
        first_slurm_host(nodelist)


def test_two_srun_steps_of_one_job_get_two_ports():
    """``srun ... &`` twice in one allocation: both steps start on the job's first node."""
    ports = {slurm_master_port({"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": str(step)}) for step in range(64)}
    assert len(ports) == 64 and all(15000 <= port < 25000 for port in ports)
    neighbours = {slurm_master_port({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0"}) for job in range(123450, 123460)}
    assert not ports & (neighbours - {slurm_master_port({"SLURM_JOB_ID": "123456"})})
