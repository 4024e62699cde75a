"""``.deepspeed_env`` parsing and application (DeepSpeed issue 6901)."""
import pytest

from deepspeed_xla.env_file import apply_deepspeed_env, env_file_paths, parse_env_text


def test_parser_tolerates_what_users_write():
    text = "\n# comment\nexport DS_ACCELERATOR=xla\nPJRT_DEVICE = 'CPU'\nXLA_FLAGS=\"--xla_a=1 --xla_b=2\"\n\nK=a=b\n"
    assert parse_env_text(text) == {"DS_ACCELERATOR": "xla", "PJRT_DEVICE": "CPU",
                                    "XLA_FLAGS": "--xla_a=1 --xla_b=2", "K": "a=b"}


@pytest.mark.parametrize("line", ["JUST_A_NAME", "1BAD=x", "=value"])
def test_malformed_line_names_file_line_and_fix(line):
    with pytest.raises(ValueError, match=r"envfile:2: .* NAME=value"):
        parse_env_text(f"OK=1\n{line}\n", "envfile")


def test_precedence_home_then_cwd_and_shell_wins(tmp_path, monkeypatch, capsys):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\nC=home\n")
    (cwd / ".deepspeed_env").write_text("B=cwd\nC=cwd\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    environ = {"C": "shell"}
    applied = apply_deepspeed_env(environ)
    assert environ == {"A": "home", "B": "cwd", "C": "shell"}
    assert applied == {"A": "home", "B": "cwd"}
    assert "C from .deepspeed_env" in capsys.readouterr().err


def test_ds_env_file_renames_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "custom.env").write_text("X=1\n")
    assert env_file_paths({"DS_ENV_FILE": "custom.env"}) == [str(tmp_path / "custom.env")]


def test_multi_node_runner_forwards_env_file_and_xla_variables(tmp_path):
    """``deepspeed --force_multi`` (pdsh): DeepSpeed's own parser would fail on the blank and comment lines;
    the runner must pick the XLA accelerator from the file and forward PJRT_/XLA_ variables."""
    import os

    from tests.conftest import VENV_BIN, clean_env
    from tests.multiproc import run_command
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    record = tmp_path / "pdsh-args.txt"
    (fake_bin / "pdsh").write_text(f"#!/bin/sh\necho \"$@\" > {record}\n")
    (fake_bin / "pdsh").chmod(0o755)
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    (tmp_path / ".deepspeed_env").write_text("\n# cluster settings\nexport DS_ACCELERATOR=xla\nXLA_FLAGS='--a=1'\n")
    env = clean_env(HOME=tmp_path, PJRT_DEVICE="CPU")
    env["PATH"] = f"{fake_bin}{os.pathsep}{env['PATH']}"
    proc = run_command([str(VENV_BIN / "deepspeed"), "--force_multi", "--hostfile", str(tmp_path / "hostfile"),
                        "--no_ssh_check", "--master_addr", "127.0.0.1", "--launcher", "pdsh", "train.py"], 300,
                       cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    command = record.read_text()
    assert "export DS_ACCELERATOR=xla" in command
    assert "export PJRT_DEVICE=CPU" in command
    assert "export XLA_FLAGS=--a=1" in command
