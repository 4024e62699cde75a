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
