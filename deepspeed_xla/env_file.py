"""``.deepspeed_env`` for every launch, not only multi-node ones (DeepSpeed issue 6901).

DeepSpeed's runner reads ``~/.deepspeed_env`` then ``./.deepspeed_env`` (name from ``DS_ENV_FILE``),
later files winning, but only to export them to remote hosts, and its parser fails on blank lines.
This module reads the same files in the same order, tolerating blank lines, ``#`` comments,
``export`` prefixes, quotes and ``=`` inside values, refusing what a remote shell would read otherwise
(``$VAR``, a ``# comment`` after a value), and applies them to the runner's own environment
so that the runner, ``launch.py`` and every worker see them; a variable the shell set keeps the shell's
value, here and on every host (``values_for_hosts``).

A file applies to every process of the job, so it is refused when another user could have written it (as ssh
refuses such a config), and it may set the variables that choose which programs and libraries load
(``LOADER_VARIABLES``) only when the shell names them in ``DS_XLA_ENV_FILE_ALLOW``. Imported by the startup
hook: os only.
"""
import grp
import os
import pwd
import re
import stat
import sys
from typing import Dict, List, Mapping, MutableMapping, Tuple

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_INLINE_COMMENT = re.compile(r"\s#")
# A ``$`` or backquote a shell would expand; ``\$`` and ``\``` are the escapes for the characters themselves.
_EXPANSION = re.compile(r"(?<!\\)(\$[A-Za-z_{(]|`)")
_ESCAPE = re.compile(r"\\([$`])")
#: Variables that choose which programs, libraries and Python code every process of the job loads: a
#: ``.deepspeed_env`` sets them only when the launching shell lists them in ``ALLOW_ENV``.
LOADER_VARIABLES = ("LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PATH", "PYTHONPATH", "PYTHONHOME",
                    "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONBREAKPOINT", "BASH_ENV", "ENV",
                    "TPU_LIBRARY_PATH", "TORCH_EXTENSIONS_DIR")  # the libtpu.so torch_xla loads; DeepSpeed's op .so
#: Comma-separated names of ``LOADER_VARIABLES`` the env files may set; read from the shell only.
ALLOW_ENV = "DS_XLA_ENV_FILE_ALLOW"


def env_file_paths(environ: Mapping[str, str] = os.environ) -> List[str]:
    """The files DeepSpeed's runner would read, lowest precedence first. A ``DS_ENV_FILE`` that names no file is
    an error: the user asked for settings that would otherwise be silently missing."""
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    paths = [os.path.join(os.path.expanduser("~"), name), os.path.join(".", name)]
    seen, result = set(), []
    for path in paths:
        real = os.path.realpath(path)
        if os.path.isfile(path) and real not in seen:
            seen.add(real)
            result.append(path)
    if "DS_ENV_FILE" in environ and not result:
        raise FileNotFoundError(f"DS_ENV_FILE={name!r} names no file: neither {paths[0]} nor "
                                f"{os.path.abspath(paths[1])} exists. Set DS_ENV_FILE to the file's name (relative "
                                "to the working directory or home) or to its absolute path, or unset it.")
    return result


def _value(key: str, value: str, where: str) -> str:
    """A value as the remote shell would read it: single quotes keep every character, ``\\$`` and ``\\``` stand
    for the characters themselves, an unescaped expansion is refused."""
    if len(value) >= 2 and value[0] == value[-1] == "'":
        return value[1:-1]
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    elif _INLINE_COMMENT.search(value):
        raise ValueError(f"{where}: {key}'s value {value!r} has a # comment after it, which a shell "
                         "drops and this file keeps: put the comment on a line of its own (or quote the value "
                         "if the # belongs to it).")
    if _EXPANSION.search(value):
        raise ValueError(f"{where}: {key}={value!r} asks for shell expansion, which .deepspeed_env "
                         "values never get (every host receives the characters as written): write the value "
                         "itself; for a literal $ or backquote write \\$ or \\` (or single-quote the value).")
    return _ESCAPE.sub(r"\1", value)


def parse_env_text(text: str, source: str = "<string>") -> Dict[str, str]:
    values = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            raise ValueError(f"{source}:{number}: {raw.strip()!r} is not a NAME=value line; write it as "
                             "NAME=value (blank lines and # comments are allowed).")
        values[key] = _value(key, value.strip(), f"{source}:{number}")
    return values


def _private_group(gid: int, uid: int) -> bool:
    """The owner's own group (Debian's user private groups, umask 002): named as the user, no other member."""
    try:
        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except KeyError:
        return False
    return user.pw_gid == gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def check_file_trusted(path: str) -> None:
    """Refuse a file that a user other than this one (or root) owns or may write, as ssh refuses its config: its
    values reach every process of the job."""
    info = os.stat(path)
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid not in (os.geteuid(), 0):
        raise PermissionError(f"{path} is owned by uid {info.st_uid}, not by you (uid {os.geteuid()}) or root, and "
                              "sets the environment of every process of the job: take it over (chown) after checking "
                              "what it sets, or remove it.")
    if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and not _private_group(info.st_gid, info.st_uid)):
        raise PermissionError(f"{path} can be written by other users (mode {mode:o}), and sets the environment of "
                              f"every process of the job: chmod go-w {path}.")


def _check_loader_variables(path: str, values: Mapping[str, str], environ: Mapping[str, str]) -> None:
    allowed = {name.strip() for name in environ.get(ALLOW_ENV, "").split(",")}
    if ALLOW_ENV in values:
        raise ValueError(f"{path} sets {ALLOW_ENV}, which only the shell that launches may set: remove it from "
                         "the file.")
    refused = [key for key in values if key in LOADER_VARIABLES and key not in allowed]
    if refused:
        names = ",".join(refused)
        raise ValueError(f"{path} sets {', '.join(refused)}, which choose{'s' if len(refused) == 1 else ''} the "
                         "programs and libraries every process of the job loads, on every host: remove "
                         f"{'it' if len(refused) == 1 else 'them'} from the file, or allow "
                         f"{'it' if len(refused) == 1 else 'them'} in the shell that launches: "
                         f"export {ALLOW_ENV}={names}")


def read_env_files(environ: Mapping[str, str] = os.environ) -> List[Tuple[str, Dict[str, str]]]:
    result = []
    for path in env_file_paths(environ):
        check_file_trusted(path)
        with open(path) as handle:
            values = parse_env_text(handle.read(), path)
        _check_loader_variables(path, values, environ)
        result.append((path, values))
    return result


def merged_env_values(environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """What the env files set, later files winning (DeepSpeed's precedence)."""
    merged: Dict[str, str] = {}
    for _, values in read_env_files(environ):
        merged.update(values)
    return merged


def values_for_hosts(environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """What a multi-node runner exports to every host for the env files' variables: the runner's own value of each
    (the shell's, where the shell set one, as ``apply_deepspeed_env`` says), so every host runs as this one."""
    return {key: environ.get(key, value) for key, value in merged_env_values(environ).items()}


def apply_deepspeed_env(environ: MutableMapping[str, str]) -> Dict[str, str]:
    """Set variables from the env files that the shell did not set; returns what was applied."""
    merged = merged_env_values(environ)
    applied = {}
    for key, value in merged.items():
        if key in environ:
            if environ[key] != value:
                print(f"deepspeed_xla: {key} from .deepspeed_env ({value!r}) is overridden by the shell "
                      f"({environ[key]!r}) here and on every host; unset it in the shell to use the file's value.",
                      file=sys.stderr)
            continue
        environ[key] = value
        applied[key] = value
    return applied
