"""``patches/launcher.py``: what DeepSpeed's multi-node runners export arrives as written, the runners that start
the script directly pass on the rendezvous address, pdsh refuses hosts ssh cannot reach, and the job's secret is made
by the runner and reaches every host on no command line."""
import os
import shlex
import subprocess
import sys

import pytest
from deepspeed.launcher import multinode_runner
from deepspeed.launcher.runner import parse_args

from deepspeed_xla.bootstrap import JOB_SECRET, JOB_SECRET_FILE
from deepspeed_xla.patches import launcher
from tests.conftest import clean_env

pytestmark = pytest.mark.usefixtures("launch_env")  # the runner's parse_args makes the job's secret in os.environ

TRICKY = {"SPACES": "two  words", "EQUALS": "a=b=c", "FLAGS": "--xla_a=1 --xla_b=2", "SHELL": "it's \"$HOME\" `x`"}


def _runner(cls, launcher_name: str, *extra: str):
    args = parse_args(["--launcher", launcher_name, "--master_addr", "127.0.0.1", "--master_port", "1234",
                       "--hostfile", "/nonexistent", *extra, "train.py", "--x", "1"])
    runner = (cls(args, "e30=") if cls is multinode_runner.PDSHRunner else cls(args, "e30=", {"localhost": 2}))
    for key, value in TRICKY.items():
        runner.add_export(key, f"{value}\n")  # as DeepSpeed reads them from .deepspeed_env lines
    return runner


def test_pdsh_exports_survive_the_remote_shell():
    runner = _runner(multinode_runner.PDSHRunner, "pdsh")
    exports = "".join(f"export {key}={value}; " for key, value in runner.exports.items())
    printed = subprocess.run(["sh", "-c", exports + "printf '%s\\n' \"$SPACES\" \"$EQUALS\" \"$FLAGS\" \"$SHELL\""],
                             capture_output=True, text=True, check=True).stdout
    assert printed.splitlines() == list(TRICKY.values())


@pytest.mark.parametrize("cls, name, flag", [(multinode_runner.OpenMPIRunner, "openmpi", "-x"),
                                             (multinode_runner.SlurmRunner, "slurm", None)])
def test_direct_launchers_get_exact_values_and_the_rendezvous(cls, name, flag):
    cmd = _runner(cls, name).get_cmd({}, {"localhost": [0, 1]})
    expected = [*(f"{key}={value}" for key, value in TRICKY.items()), "MASTER_ADDR=127.0.0.1", "MASTER_PORT=1234"]
    if flag:
        given = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == flag]
    else:
        given = next(arg for arg in cmd if arg.startswith("--export=ALL,")).split(",")[1:]
    assert [entry for entry in given if entry.split("=")[0] in {*TRICKY, "MASTER_ADDR", "MASTER_PORT"}] == expected


def test_rendezvous_from_deepspeed_env_wins():
    runner = _runner(multinode_runner.OpenMPIRunner, "openmpi")
    runner.add_export("MASTER_ADDR", "10.1.2.3")
    cmd = runner.get_cmd({}, {"localhost": [0, 1]})
    assert "MASTER_ADDR=10.1.2.3" in cmd and "MASTER_ADDR=127.0.0.1" not in cmd


def test_unreachable_hosts_are_named_with_sshs_reason(tmp_path, monkeypatch):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "ssh").write_text("#!/bin/sh\ncase \"$*\" in *' down true') "
                                  "echo 'ssh: connect to host down: refused' >&2; exit 255;; esac\n")
    (fake_bin / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:/usr/bin:/bin")
    assert launcher.unreachable_hosts(["up", "down", "also-up"], ["-p", "22"]) == {
        "down": "ssh: connect to host down: refused"}


def test_a_host_slower_than_the_limit_is_named_with_the_variable_that_raises_it(tmp_path, monkeypatch):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "ssh").write_text("#!/bin/sh\nexec sleep 2\n")
    (fake_bin / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:/usr/bin:/bin")
    monkeypatch.setenv(launcher.SSH_CHECK_TIMEOUT_ENV, "0.5")
    assert launcher.unreachable_hosts(["slow"], []) == {
        "slow": f"no answer within 0.5 s (a host that is slow to answer: raise the limit with "
                f"{launcher.SSH_CHECK_TIMEOUT_ENV}=<seconds>)"}
    monkeypatch.setenv(launcher.SSH_CHECK_TIMEOUT_ENV, "10")
    assert launcher.unreachable_hosts(["slow"], []) == {}
    monkeypatch.setenv(launcher.SSH_CHECK_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=rf"{launcher.SSH_CHECK_TIMEOUT_ENV}='soon' is not a number"):
        launcher.unreachable_hosts(["slow"], [])


@pytest.mark.parametrize("name", ["-oProxyCommand=touch /tmp/x", "-p"])
def test_a_hostfile_host_that_ssh_would_read_as_an_option_is_refused(tmp_path, name):
    from deepspeed.launcher import runner
    (tmp_path / "hostfile").write_text(f"worker-0 slots=4\n{name.split()[0]} slots=4\n")
    with pytest.raises(ValueError, match=r"the hostfile names '-\S*': a host name cannot start with '-'"):
        runner.fetch_hostfile(str(tmp_path / "hostfile"))


def test_srun_gets_a_value_with_a_comma_whole_through_its_environment():
    """``--export=ALL,A=1,2`` would give the tasks A=1 (and look up a variable named 2): srun's own environment,
    which ``ALL`` hands every task, carries it instead."""
    runner = _runner(multinode_runner.SlurmRunner, "slurm")
    runner.add_export("XLA_FLAGS", "--xla_dump_hlo_pass_re=a,b --x=1")
    environment = {}
    cmd = runner.get_cmd(environment, {"localhost": [0, 1]})
    export = next(arg for arg in cmd if arg.startswith("--export=ALL"))
    assert "XLA_FLAGS" not in export and environment["XLA_FLAGS"] == "--xla_dump_hlo_pass_re=a,b --x=1"
    assert "EQUALS=a=b=c" in export.split(",")


def _runners_deepspeed_env(tmp_path, home_text: str, shell: dict) -> subprocess.CompletedProcess:
    """A process that builds the runner's normalized ``.deepspeed_env`` from ``home_text`` and prints where DeepSpeed's
    runner will read it and what it reads there, then exits."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text(home_text)
    code = ("import os; from deepspeed_xla.patches import launcher; "
            "path = os.path.join(launcher.runner_env_paths(['~', '.'])[0], launcher.runner_env_name('.deepspeed_env'));"
            "print(path); print(open(path).read(), end='')")
    env = clean_env(HOME=str(home), TMPDIR=str(tmp_path), **shell)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=True, timeout=120)


def test_the_runners_deepspeed_env_holds_the_value_its_message_says_wins(tmp_path):
    """Every host gets the value the runner says wins (the shell's, test_env_file.py), as the runner's own host."""
    proc = _runners_deepspeed_env(tmp_path, "TOKEN=secret\nBOTH=file\n", {"BOTH": "shell"})
    assert proc.stdout.splitlines()[1:] == ["TOKEN=secret", "BOTH=shell"]


def test_the_runners_copy_of_the_deepspeed_env_is_never_on_disk(tmp_path):
    """The copy holds the file's values, tokens included: in the runner's memory only, so nothing of it stays
    behind, however the runner ends."""
    path = _runners_deepspeed_env(tmp_path, "TOKEN=secret\n", {}).stdout.splitlines()[0]
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["home"], "a copy left in TMPDIR"
    assert path.startswith("/proc/self/fd/")


def test_the_runner_makes_a_secret_unless_one_is_set_or_each_host_has_its_own_runner(monkeypatch):
    from deepspeed.launcher import runner
    arguments = ["--master_port", "1234", "train.py"]
    runner.parse_args(arguments)
    made = os.environ[JOB_SECRET]
    assert len(made) == 64 and int(made, 16)
    monkeypatch.delenv(JOB_SECRET)
    runner.parse_args(arguments)
    assert os.environ[JOB_SECRET] != made, "one secret per job"
    for set_by_user in ("mine", ""):  # empty: none
        monkeypatch.setenv(JOB_SECRET, set_by_user)
        runner.parse_args(arguments)
        assert os.environ[JOB_SECRET] == set_by_user
    monkeypatch.delenv(JOB_SECRET)
    runner.parse_args(["--no_ssh", "--node_rank", "0", *arguments])  # one runner per host: they cannot agree
    assert JOB_SECRET not in os.environ


SECRET = "0123abcd" * 8


@pytest.mark.parametrize("cls, name", [(multinode_runner.OpenMPIRunner, "openmpi"),
                                       (multinode_runner.MPICHRunner, "mpich"),
                                       (multinode_runner.MVAPICHRunner, "mvapich"),
                                       (multinode_runner.SlurmRunner, "slurm")])
def test_the_direct_launchers_hand_the_secret_on_no_command_line(cls, name, monkeypatch, tmp_path):
    """DeepSpeed's runner exports ``DS_XLA_*`` and logs its command: the secret is not among the exports. OpenMPI
    is given its name; the others pass their environment (``--export=ALL``, hydra) to every rank."""
    monkeypatch.chdir(tmp_path)  # MVAPICH's runner writes a hostfile in the working folder
    runner = _runner(cls, name)
    runner.add_export(JOB_SECRET, SECRET)
    cmd = runner.get_cmd({JOB_SECRET: SECRET}, {"localhost": [0, 1]})
    assert JOB_SECRET not in runner.exports and not any(SECRET in arg for arg in cmd), cmd
    assert (cmd[:3] == ["mpirun", "-x", JOB_SECRET]) == (name == "openmpi"), cmd


def test_pdsh_hands_each_host_the_secret_through_ssh_into_a_file_its_launcher_reads_and_removes(tmp_path,
                                                                                                 monkeypatch):
    home, fake_bin = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    fake_bin.mkdir()
    # ssh <options> -- <host> <command>: run the command here, as the host's shell would, with its own HOME.
    (fake_bin / "ssh").write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path}/ssh.log\nwhile [ \"$1\" != -- ]; do shift; "
                                  f"done\nHOME={home} exec sh -c \"$3\"\n")
    (fake_bin / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:/usr/bin:/bin")
    runner = _runner(multinode_runner.PDSHRunner, "pdsh")
    runner.add_export(JOB_SECRET, SECRET)
    cmd, _, _ = runner.get_cmd({JOB_SECRET: SECRET}, {"host-a": [0], "host-b": [0]})
    assert not any(SECRET in arg for arg in cmd) and SECRET not in (tmp_path / "ssh.log").read_text(), cmd
    written = sorted((home / ".cache" / "deepspeed_xla").iterdir())  # one home for both hosts, as on NFS
    assert [path.read_text() for path in written] == [SECRET] * 2
    assert all(path.stat().st_mode & 0o777 == 0o600 for path in written)
    exported = runner.exports[JOB_SECRET_FILE]
    assert f"export {JOB_SECRET_FILE}={exported}; " in cmd[cmd.index("host-a,host-b") + 1]
    for node_rank, path in enumerate(written):
        # The host's launcher: the sh of pdsh's command with its %n replaced, then Python, whose startup hook moves
        # the secret into the environment.
        code = f"import os; print(os.environ.get({JOB_SECRET!r}), {JOB_SECRET_FILE!r} in os.environ)"
        shell = f"export {JOB_SECRET_FILE}={exported}; {sys.executable} -c {shlex.quote(code)}"
        printed = subprocess.run(["sh", "-c", shell.replace("%n", str(node_rank))], env=clean_env(HOME=str(home)),
                                 capture_output=True, text=True, check=True).stdout
        assert printed.split() == [SECRET, "False"]
        assert not path.exists()
