"""``patches/launcher.py``: what DeepSpeed's multi-node runners export arrives as written, the runners that start
the script directly pass on the rendezvous address, and pdsh refuses hosts ssh cannot reach."""
import os
import subprocess
import sys

import pytest
from deepspeed.launcher import multinode_runner
from deepspeed.launcher.runner import parse_args

from deepspeed_xla.patches import launcher
from tests.conftest import clean_env

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
