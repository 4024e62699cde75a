"""``.deepspeed_env`` parsing and application (DeepSpeed issue 6901). What a multi-node runner hands every host
is tested through a real pdsh and sshd: tests/launched/test_launchers.py."""
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


@pytest.mark.parametrize("line, problem", [
    ("CACHE=$HOME/cache", "asks for shell expansion"), ("P=${PWD}", "asks for shell expansion"),
    ("H=`hostname`", "asks for shell expansion"), ("N=$(nproc)", "asks for shell expansion"),
    ("PJRT_DEVICE=TPU  # the pod", "has a # comment after it"),
])
def test_what_a_remote_shell_would_read_otherwise_is_refused(line, problem):
    """.deepspeed_env values reach every host as written (pdsh's shell gets them quoted): a value that asks for
    the shell, or a trailing comment the shell would drop, cannot mean the same here and there."""
    with pytest.raises(ValueError, match=rf"envfile:1: .*{problem}"):
        parse_env_text(f"{line}\n", "envfile")


def test_literal_dollars_and_hashes_that_mean_the_same_everywhere_are_kept():
    assert parse_env_text("A=cost$5\nB='x # y'\nC=a#b\n") == {"A": "cost$5", "B": "x # y", "C": "a#b"}


def test_loader_variables_are_applied_with_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".deepspeed_env").write_text("LD_PRELOAD=/opt/libtcmalloc.so\nOTHER=1\n")
    environ = {}
    assert apply_deepspeed_env(environ) == {"LD_PRELOAD": "/opt/libtcmalloc.so", "OTHER": "1"}
    err = capsys.readouterr().err
    assert "sets LD_PRELOAD='/opt/libtcmalloc.so' for every process of the job on every host" in err
    assert "OTHER" not in err
