"""``.deepspeed_env`` parsing and application (DeepSpeed issue 6901). What a multi-node runner hands every host
is tested through a real pdsh and sshd: tests/launched/test_launchers.py."""
import grp
import os
import pwd
import subprocess

import pytest

from deepspeed_xla.env_file import (ALLOW_ENV, LOADER_VARIABLES, apply_deepspeed_env, env_file_paths, parse_env_text,
                                    read_env_files, values_for_hosts)


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


@pytest.mark.parametrize("line", [r"A=\$HOME/x", "A='$HOME `id`'", r'A="cost \${X} \`y\`"', r'A="\$(nproc)"'])
def test_escaped_and_single_quoted_dollars_and_backquotes_mean_what_a_shell_reads(line):
    """``\\$``, ``\\``` and single quotes: the characters themselves, as a shell reading the line keeps them."""
    shell = subprocess.run(["sh", "-c", f"{line}\nprintf '%s' \"$A\""], capture_output=True, text=True, check=True,
                           env={"HOME": "/expanded", "X": "expanded", "PATH": os.environ["PATH"]}).stdout
    assert "expanded" not in shell
    assert parse_env_text(line) == {"A": shell}


@pytest.mark.parametrize("line", ['A="$HOME"', r"A=\$x$HOME", r'A="\`x\` `id`"'])
def test_an_unescaped_expansion_is_refused_beside_an_escaped_one(line):
    with pytest.raises(ValueError, match=r"asks for shell expansion.*write \\\$ or \\`"):
        parse_env_text(line, "envfile")


def test_ds_env_file_naming_no_file_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"DS_ENV_FILE='cluster.env' names no file: neither .*home/cluster.env "
                                                r"nor .*/cluster.env exists\. Set DS_ENV_FILE to the file's name"):
        apply_deepspeed_env({"DS_ENV_FILE": "cluster.env"})
    assert env_file_paths({}) == []  # without DS_ENV_FILE, no file is no error


def _env_file(tmp_path, monkeypatch, text: str):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    path = tmp_path / ".deepspeed_env"
    path.write_text(text)
    path.chmod(0o644)
    return path


def _shared_group(owner: int) -> int:
    """A group that is not ``owner``'s private group (one named otherwise)."""
    name = pwd.getpwuid(owner).pw_name
    return next(group.gr_gid for group in grp.getgrall() if group.gr_name != name)


def test_a_file_other_users_can_write_is_refused(tmp_path, monkeypatch):
    path = _env_file(tmp_path, monkeypatch, "DS_ACCELERATOR=xla\n")
    assert apply_deepspeed_env({}) == {"DS_ACCELERATOR": "xla"}
    path.chmod(0o646)
    with pytest.raises(PermissionError, match=rf"{path} can be written by other users \(mode 646\).*chmod go-w {path}"):
        apply_deepspeed_env({})
    path.chmod(0o664)
    os.chown(path, -1, _shared_group(os.geteuid()))
    with pytest.raises(PermissionError, match=r"can be written by other users \(mode 664\)"):
        apply_deepspeed_env({})


def test_a_file_another_user_owns_is_refused(tmp_path, monkeypatch):
    """As ssh: a file owned by root or by this user is trusted; the tests run as root, so a user id of nobody's."""
    path = _env_file(tmp_path, monkeypatch, "DS_ACCELERATOR=xla\n")
    os.chown(path, 54321, -1)
    with pytest.raises(PermissionError, match=rf"{path} is owned by uid 54321, not by you .*chown.* or remove it"):
        apply_deepspeed_env({})


def test_loader_variables_are_refused_unless_the_shell_allows_them(tmp_path, monkeypatch):
    assert {"LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PATH", "TPU_LIBRARY_PATH",
            "TORCH_EXTENSIONS_DIR"} <= {
        *LOADER_VARIABLES}
    _env_file(tmp_path, monkeypatch, "LD_PRELOAD=/opt/libtcmalloc.so\nOTHER=1\nPYTHONPATH=/opt/lib\n")
    with pytest.raises(ValueError, match=r"\.deepspeed_env sets LD_PRELOAD, PYTHONPATH, which choose the programs and "
                                         rf"libraries .*export {ALLOW_ENV}=LD_PRELOAD,PYTHONPATH$"):
        apply_deepspeed_env({})
    with pytest.raises(ValueError, match=rf"sets PYTHONPATH, which chooses .*export {ALLOW_ENV}=PYTHONPATH$"):
        apply_deepspeed_env({ALLOW_ENV: "LD_PRELOAD"})
    environ = {ALLOW_ENV: "LD_PRELOAD, PYTHONPATH"}
    assert apply_deepspeed_env(environ) == {"LD_PRELOAD": "/opt/libtcmalloc.so", "OTHER": "1", "PYTHONPATH": "/opt/lib"}


def test_only_the_shell_may_allow_loader_variables(tmp_path, monkeypatch):
    _env_file(tmp_path, monkeypatch, f"{ALLOW_ENV}=PYTHONPATH\nPYTHONPATH=/opt/lib\n")
    with pytest.raises(ValueError, match=rf"sets {ALLOW_ENV}, which only the shell that launches may set"):
        read_env_files({})


def test_every_host_gets_the_value_this_host_runs_with(tmp_path, monkeypatch, capsys):
    """The runner says the shell's value wins; what it hands the other hosts (``values_for_hosts``) says the same."""
    _env_file(tmp_path, monkeypatch, "FROM_FILE=file\nBOTH=file\n")
    environ = {"BOTH": "shell"}
    apply_deepspeed_env(environ)
    assert "BOTH from .deepspeed_env ('file') is overridden by the shell ('shell') here and on every host" in \
        capsys.readouterr().err
    assert values_for_hosts(environ) == {"FROM_FILE": "file", "BOTH": "shell"}
