"""DeepSpeed's multi-node launchers for real, on loopback: pdsh through a test sshd to two host names, ``--no_ssh``
(one runner per node), OpenMPI, MPICH and a one-node Slurm cluster (through ``deepspeed --launcher slurm`` and
through ``srun`` itself). Each starts the 2 XLA ranks of the ZeRO-2 run that test_multiprocess_training.py
compares, and is compared with DeepSpeed's CPU accelerator the same way. Needs sshd, pdsh, OpenMPI, MPICH and
Slurm (.ci/run installs them).

    python -m pytest tests/launched/test_launchers.py
"""
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil
import pytest

from deepspeed_xla.bootstrap import JOB_SECRET, JOB_SECRET_FILE
from deepspeed_xla.launch_env import free_port
from tests import services
from tests.conftest import FAST_COMPILE, FIXTURES, VENV_BIN, clean_env
from tests.multiproc import (TRAIN, TWO_RANK_RUN, assert_trains_like, ds_config, kill_group, last_error,
                             read_results, run_command, run_job, start_command, train_arguments)

CONFIG = ds_config(2)
PROBE_DIR = FIXTURES / "runtime_probe"
# Every MPI transport on the loopback interface (DeepSpeed's OpenMPI runner would otherwise add
# btl_tcp_if_include eth0); the MPI launchers run as root only when told so.
OPENMPI_ARGS = "--mca btl_tcp_if_include lo --mca oob_tcp_if_include lo --mca pml ob1 --bind-to none"
OPENMPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MPICH_ARGS = "-iface lo"  # passed as --launcher_args=...: argparse reads "-iface" as -i (--include) "face"
# What .deepspeed_env hands every host in the pdsh run, values with spaces and '=' among them.
ENV_FILE_VALUES = {"DSX_TEST_SPACES": "two  words and more", "DSX_TEST_EQUALS": "a=b=c"}
# Set in .deepspeed_env and in the runner's shell: the runner says the shell's value wins, and every host gets it.
SHELL_WINS = {"DSX_TEST_SHELL_WINS": "shell"}


def _mpirun(folder: Path, implementation: str) -> Dict[str, str]:
    """PATH entries under which ``mpirun`` is ``implementation``'s (Debian installs both side by side)."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "mpirun"  # not a symlink: MPICH finds its hydra_pmi_proxy beside the mpirun it ran as
    wrapper.write_text(f"#!/bin/sh\nexec /usr/bin/mpirun.{implementation} \"$@\"\n")
    wrapper.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{clean_env()['PATH']}"}


def _command(workdir: Path, command: List[str], hosts: Optional[str], env: Optional[dict],
             steps: int = TWO_RANK_RUN["steps"]):
    """``command`` (the ``deepspeed`` CLI's or ``srun``'s arguments before the script) with ``scripts/train.py``
    and the ZeRO-2 run's arguments after it, its environment (XLA, gloo on loopback, then ``env``), and where
    rank 0's JSON goes. ``hosts``: the hostfile's text, passed as ``--hostfile``."""
    args, out = train_arguments(workdir, "xla", CONFIG, steps)
    if hosts is not None:
        (workdir / "hostfile").write_text(hosts)
        command = [command[0], "--hostfile", str(workdir / "hostfile"), *command[1:]]
    return [*command, str(TRAIN), *args], clean_env(**{"DS_ACCELERATOR": "xla", "GLOO_SOCKET_IFNAME": "lo",
                                                         **(env or {})}), out


def launch(workdir: Path, command: List[str], hosts: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``_command``'s run, which may fail."""
    cmd, env, _ = _command(workdir, command, hosts, env)
    return run_command(cmd, timeout, cwd=workdir, env=env)


def deepspeed(*args: str) -> List[str]:
    """The ``deepspeed`` CLI on loopback: ``--master_addr 127.0.0.1`` (it would ask ``hostname -I``)."""
    return [str(VENV_BIN / "deepspeed"), "--master_addr", services.LOOPBACK, "--master_port", str(free_port()),
            *args]


def trained(workdir: Path, command: List[str], hosts: Optional[str] = "localhost slots=2\n",
            env: Optional[dict] = None) -> dict:
    """``_command``'s run, which must succeed; every rank's JSON (``read_results``) and, under ``"output"``, what the
    command printed."""
    cmd, env, out = _command(workdir, command, hosts, env)
    proc = run_job(cmd, env, workdir, timeout=300)
    return {**read_results(out, 2), "output": proc.stdout + proc.stderr}


def probed(workdir: Path, *recorded: str, **values: str) -> dict:
    """A ``.deepspeed_env`` in ``workdir`` (which the runner hands every host) with ``values`` and the runtime probe,
    which records ``recorded`` and the job's secret in every process; the probe's log is ``runtime.jsonl``."""
    values = {"PYTHONPATH": str(PROBE_DIR), "DSX_TEST_RUNTIME_LOG": str(workdir / "runtime.jsonl"),
              "DSX_TEST_RECORD_ENV": ",".join([*recorded, JOB_SECRET, JOB_SECRET_FILE]), **values}
    (workdir / ".deepspeed_env").write_text("".join(f"{key}={value}\n" for key, value in values.items()))
    return {"DS_XLA_ENV_FILE_ALLOW": "PYTHONPATH", "PYTHONPATH": None}


def runtime(workdir: Path) -> List[dict]:
    """Every probed process's record (``probed``)."""
    return [json.loads(line) for line in (workdir / "runtime.jsonl").read_text().splitlines()]


def assert_one_secret_on_no_command_line(run: dict, records: List[dict]) -> None:
    """Every rank and host launcher has the one secret the runner made, and the runner's log (its command) lacks it."""
    ranks = [record for record in records if record["argv"][0].endswith("train.py")]
    secrets = {record["env"][JOB_SECRET] for record in records}
    assert len(ranks) == 2 and len(secrets) == 1, records
    [secret] = secrets
    assert secret and len(secret) == 64 and secret not in run["output"], secret
    assert not any(record["env"][JOB_SECRET_FILE] for record in records)


@pytest.fixture(scope="module")
def cpu_run(trainings) -> dict:
    return trainings.run("cpu", CONFIG, **TWO_RANK_RUN)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    with services.sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


def _pdsh_env(sshd: dict, **extra) -> dict:
    return {"PDSH_SSH_ARGS_APPEND": sshd["ssh_args"], **extra}


@pytest.fixture(scope="module")
def pdsh_run(tmp_path_factory, sshd) -> dict:
    """``deepspeed --hostfile`` over pdsh and ssh to two loopback host names, one rank each, ``DS_ACCELERATOR``
    and the rest only in the runner's ``.deepspeed_env``; every process records its environment at exit."""
    workdir = tmp_path_factory.mktemp("pdsh")
    recorded = [*ENV_FILE_VALUES, *SHELL_WINS, "HOME", "RANK", "CROSS_RANK", "PJRT_DEVICE", "XLA_FLAGS"]
    # PYTHONPATH only in .deepspeed_env (the shell's would win), which the shell must allow.
    env = probed(workdir, *recorded, PYTHONPATH=os.pathsep.join([str(PROBE_DIR), str(FIXTURES / "cpuinfo_cache")]),
                 **ENV_FILE_VALUES, **dict.fromkeys(SHELL_WINS, "file"))
    # Blank and comment lines and ``export``, which DeepSpeed's own parser of the file would fail on.
    env_file = workdir / ".deepspeed_env"
    env_file.write_text("\n# cluster settings\nexport DS_ACCELERATOR=xla\n" + env_file.read_text())
    env = _pdsh_env(sshd, DS_ACCELERATOR=None, **env, **SHELL_WINS)
    result = trained(workdir, deepspeed("--ssh_port", sshd["port"], "--no_ssh_check"),
                     hosts="localhost slots=1\n127.0.0.1 slots=1\n", env=env)
    return {**result, "runtime": runtime(workdir)}


def test_pdsh_over_ssh_matches_cpu_accelerator(pdsh_run, cpu_run):
    assert_trains_like(pdsh_run, cpu_run, "float32")


def test_pdsh_hosts_get_the_runners_deepspeed_env(pdsh_run, sshd):
    workers = [record for record in pdsh_run["runtime"] if record["argv"][0].endswith("train.py")]
    launchers = [record for record in pdsh_run["runtime"] if record["argv"][0].endswith("launch.py")]
    assert sorted((w["env"]["RANK"], w["env"]["CROSS_RANK"]) for w in workers) == [("0", "0"), ("1", "1")]
    assert len(launchers) == 2, "one deepspeed.launcher.launch per host"
    for record in workers + launchers:
        assert record["env"]["HOME"] == sshd["home"], "not started through the test's sshd"
        assert {key: record["env"][key] for key in ENV_FILE_VALUES} == ENV_FILE_VALUES
        assert {key: record["env"][key] for key in SHELL_WINS} == SHELL_WINS, "not the value the runner says wins"
        # The runner's XLA variables, spaces and all; a worker's device set-up appends its own XLA flags.
        assert record["env"]["PJRT_DEVICE"] == "CPU"
        assert record["env"]["XLA_FLAGS"].startswith(FAST_COMPILE["XLA_FLAGS"]), record["env"]["XLA_FLAGS"]
    assert all(w["runtime_started"] for w in workers) and not any(r["torch_xla_imported"] for r in launchers)


def test_pdsh_hosts_get_the_job_secret_on_no_command_line(pdsh_run, sshd):
    """The runner made it; ssh's standard input put it in a file on each host, which the host's launcher removed."""
    assert_one_secret_on_no_command_line(pdsh_run, pdsh_run["runtime"])
    assert not list((Path(sshd["home"]) / ".cache" / "deepspeed_xla").iterdir())


def test_unreachable_host_stops_the_runner_naming_it(tmp_path, sshd):
    """127.0.0.3 has no sshd: the runner names it within seconds instead of leaving rank 0 at the rendezvous."""
    started = time.monotonic()
    proc = launch(tmp_path, deepspeed("--ssh_port", sshd["port"], "--no_ssh_check"),
                  hosts="localhost slots=1\n127.0.0.3 slots=1\n", env=_pdsh_env(sshd), timeout=120)
    assert time.monotonic() - started < 60
    error = last_error(proc)
    assert "cannot reach 127.0.0.3 over ssh" in error and "Connection refused" in error, error
    assert "localhost:" not in error


def _start_no_ssh_nodes(workdir: Path, env: Optional[dict] = None, steps: int = TWO_RANK_RUN["steps"],
                        node_envs: Sequence[dict] = ({}, {})) -> tuple:
    """``deepspeed --no_ssh --node_rank N`` for each host of a two-host hostfile, as a scheduler without ssh starts
    one per node: no runner reaches the other host. ``node_envs``: what only node 0's and node 1's environment
    hold. Returns the nodes' processes (``kill_group`` ends each), their logs, and where rank 0's JSON goes."""
    port, nodes, logs = str(free_port()), [], []
    for node in range(2):
        command = [str(VENV_BIN / "deepspeed"), "--no_ssh", "--node_rank", str(node), "--master_addr",
                   services.LOOPBACK, "--master_port", port]
        cmd, node_env, out = _command(workdir, command, "localhost slots=1\n127.0.0.1 slots=1\n",
                                      {**(env or {}), **node_envs[node]}, steps)
        logs.append(workdir / f"node{node}.log")
        with open(logs[-1], "w") as handle:
            nodes.append(start_command(cmd, cwd=workdir, env=node_env, stdout=handle, stderr=subprocess.STDOUT))
    return nodes, logs, out


def test_no_ssh_nodes_match_cpu_accelerator(tmp_path, cpu_run):
    nodes, logs, out = _start_no_ssh_nodes(tmp_path)
    try:
        codes = [node.wait(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            kill_group(node)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    assert_trains_like(read_results(out, 2), cpu_run, "float32")


def test_checkpoint_on_sigterm_on_one_host_only_stops_both_at_initialize(tmp_path):
    """Node 1 alone has ``DS_XLA_CHECKPOINT_ON_SIGTERM``: on a SIGTERM its rank would save and wait in the save's
    collectives for a rank that never saves. Both stop at ``deepspeed.initialize``, naming the variable."""
    nodes, logs, _ = _start_no_ssh_nodes(tmp_path, node_envs=({}, {"DS_XLA_CHECKPOINT_ON_SIGTERM": str(tmp_path)}))
    try:
        codes = [node.wait(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            kill_group(node)
    outputs = [log.read_text() for log in logs]
    assert codes[0] != 0 and codes[1] != 0, outputs
    for output in outputs:
        assert ('environment variable DS_XLA_CHECKPOINT_ON_SIGTERM: "set" on rank 1 (the others: "not set" on rank 0)'
                in output), output[-6000:]
        assert "step    0" not in output


def test_a_rank_killed_on_one_no_ssh_node_stops_the_other_node(tmp_path):
    """Node 1's launcher sees its worker die and fails; node 0's cannot, and no runner spans both: node 0's rank
    stops by itself, naming rank 1, within the comm timeout (one launcher for both ranks would stop them on its
    own)."""
    timeout = 30
    nodes, logs, _ = _start_no_ssh_nodes(tmp_path, {"DS_XLA_COMM_TIMEOUT": timeout}, steps=100000)
    try:
        deadline = time.monotonic() + 300
        while "step    0" not in logs[0].read_text():  # rank 0 finished a step: both ranks are training
            assert nodes[0].poll() is None and time.monotonic() < deadline, logs[0].read_text()[-6000:]
            time.sleep(0.2)
        worker, = (child for child in psutil.Process(nodes[1].pid).children(recursive=True)
                   if "--local_rank=0" in child.cmdline())  # node 1's only worker, started by its launcher
        worker.kill()
        killed = time.monotonic()
        code = nodes[0].wait(timeout=timeout + 60)
        took = time.monotonic() - killed
        killed_node_code = nodes[1].wait(timeout=60)
    finally:
        for node in nodes:
            kill_group(node)
    output = logs[0].read_text()
    assert killed_node_code != 0, logs[1].read_text()[-6000:]
    assert code != 0 and took < timeout, f"node 0 ended ({code}) {took:.1f} s after rank 1's kill:\n{output[-6000:]}"
    assert "[deepspeed_xla] rank 0 stops: rank 1 " in output, output[-6000:]


def test_openmpi_matches_cpu_accelerator(tmp_path, cpu_run):
    env = {**OPENMPI_AS_ROOT, **_mpirun(tmp_path / "bin", "openmpi"), **probed(tmp_path)}
    xla = trained(tmp_path, deepspeed("--force_multi", "--no_ssh_check", "--launcher", "openmpi",
                                      "--launcher_args", OPENMPI_ARGS), env=env)
    assert_trains_like(xla, cpu_run, "float32")
    assert_one_secret_on_no_command_line(xla, runtime(tmp_path))


def test_mpich_matches_cpu_accelerator(tmp_path, cpu_run):
    env = {**_mpirun(tmp_path / "bin", "mpich"), **probed(tmp_path)}
    xla = trained(tmp_path, deepspeed("--force_multi", "--no_ssh_check", "--launcher", "mpich",
                                      f"--launcher_args={MPICH_ARGS}"), env=env)
    assert_trains_like(xla, cpu_run, "float32")
    assert_one_secret_on_no_command_line(xla, runtime(tmp_path))


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with services.slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


# A .deepspeed_env value with commas, which srun's --export would cut at the first one.
COMMAS = {"DSX_TEST_COMMAS": "a,b,c"}


def test_deepspeed_slurm_launcher_matches_cpu_accelerator(tmp_path, slurm, cpu_run):
    """Every task gets the .deepspeed_env's values whole (commas included) and the shell's where the runner says the
    shell's wins; DS_ACCELERATOR only in the file. srun's ``--export=ALL`` lets the caller's environment (the
    runner's, which holds both) beat its ``NAME=value`` entries (srun(1)), so this holds with DeepSpeed's command
    too: the cut ``--export`` entry is checked in tests/patches/test_launcher.py."""
    env = {**slurm, **probed(tmp_path, *COMMAS, *SHELL_WINS, DS_ACCELERATOR="xla", **COMMAS,
                             **dict.fromkeys(SHELL_WINS, "file")), "DS_ACCELERATOR": None, **SHELL_WINS}
    xla = trained(tmp_path, deepspeed("--force_multi", "--no_ssh_check", "--launcher", "slurm"), env=env)
    assert_trains_like(xla, cpu_run, "float32")
    records = runtime(tmp_path)
    workers = [record for record in records if record["argv"][0].endswith("train.py")]
    assert [{key: record["env"][key] for key in (*COMMAS, *SHELL_WINS)} for record in workers] == [
        {**COMMAS, **SHELL_WINS}] * 2
    assert_one_secret_on_no_command_line(xla, records)


def test_srun_without_ntasks_per_node_matches_cpu_accelerator(tmp_path, slurm, cpu_run):
    """``srun -n 2 python train.py``: no DeepSpeed runner, no ``--ntasks-per-node``, no ``MASTER_ADDR``; ranks,
    local sizes and the rendezvous come from Slurm's variables."""
    xla = trained(tmp_path, ["srun", "-n", "2", str(VENV_BIN / "python"), "-u"], hosts=None, env=slurm)
    assert_trains_like(xla, cpu_run, "float32")
