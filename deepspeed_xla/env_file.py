"""``.deepspeed_env`` for every launch, not only multi-node ones (DeepSpeed issue 6901).

DeepSpeed's runner reads ``~/.deepspeed_env`` then ``./.deepspeed_env`` (name from ``DS_ENV_FILE``),
later files winning, but only to export them to remote hosts, and its parser fails on blank lines.
This module reads the same files in the same order, tolerating blank lines, ``#`` comments,
``export`` prefixes, quotes and ``=`` inside values, refusing what a remote shell would read otherwise
(``$VAR``, a ``# comment`` after a value), and applies them to the runner's own environment
so that the runner, ``launch.py`` and every worker see them. Imported by the startup hook: os only.
"""
import os
import re
import sys
from typing import Dict, List, MutableMapping, Tuple

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_INLINE_COMMENT = re.compile(r"\s#")
_EXPANSION = re.compile(r"\$[A-Za-z_{(]|`")
# Variables that change which programs and libraries every process of the job loads.
LOADER_VARIABLES = ("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHOME", "PATH")


def env_file_paths(environ=os.environ) -> List[str]:
    """The files DeepSpeed's runner would read, lowest precedence first."""
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    paths = [os.path.join(os.path.expanduser("~"), name), os.path.join(".", name)]
    seen, result = set(), []
    for path in paths:
        real = os.path.realpath(path)
        if os.path.isfile(path) and real not in seen:
            seen.add(real)
            result.append(path)
    return result


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
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif _INLINE_COMMENT.search(value):
            raise ValueError(f"{source}:{number}: {key}'s value {value!r} has a # comment after it, which a shell "
                             "drops and this file keeps: put the comment on a line of its own (or quote the value "
                             "if the # belongs to it).")
        if _EXPANSION.search(value):
            raise ValueError(f"{source}:{number}: {key}={value!r} asks for shell expansion, which .deepspeed_env "
                             "values never get (every host receives the characters as written): write the value "
                             "itself.")
        values[key] = value
    return values


def read_env_files(environ=os.environ) -> List[Tuple[str, Dict[str, str]]]:
    result = []
    for path in env_file_paths(environ):
        with open(path) as handle:
            result.append((path, parse_env_text(handle.read(), path)))
    return result


def merged_env_values(environ=os.environ) -> Dict[str, str]:
    """What the env files set, later files winning (DeepSpeed's precedence)."""
    merged: Dict[str, str] = {}
    for _, values in read_env_files(environ):
        merged.update(values)
    return merged


def apply_deepspeed_env(environ: MutableMapping[str, str]) -> Dict[str, str]:
    """Set variables from the env files that the shell did not set; returns what was applied."""
    merged = merged_env_values(environ)
    applied = {}
    for key, value in merged.items():
        if key in environ:
            if environ[key] != value:
                print(f"deepspeed_xla: {key} from .deepspeed_env ({value!r}) is overridden by the shell "
                      f"({environ[key]!r}); unset it in the shell to use the file's value.", file=sys.stderr)
            continue
        environ[key] = value
        applied[key] = value
        if key in LOADER_VARIABLES:
            print(f"deepspeed_xla: .deepspeed_env sets {key}={value!r} for every process of the job on every host: "
                  "it changes which programs and libraries they load.", file=sys.stderr)
    return applied
