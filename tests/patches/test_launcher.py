"""``patches/launcher.py``: what DeepSpeed's multi-node runners export arrives as written, the runners that start
the script directly pass on the rendezvous address, and pdsh refuses hosts ssh cannot reach."""
import subprocess

import pytest
from deepspeed.launcher import multinode_runner
from deepspeed.launcher.runner import parse_args

from deepspeed_xla.patches import launcher

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
