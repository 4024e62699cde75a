"""Patches of DeepSpeed's multi-node runner (``deepspeed.launcher.runner``): the ``.deepspeed_env`` it forwards.

The runner re-reads ``.deepspeed_env`` with a parser that fails on blank lines and comments, after
deepspeed_xla already parsed it; it is pointed at a normalized copy instead.
"""
import functools


_ENV_FILE_NAME = ".deepspeed_env"


@functools.lru_cache(maxsize=None)
def _normalized_env_dir() -> str:
    """One clean ``.deepspeed_env`` holding what our parser read from the user's files, or "" if none."""
    import os
    import tempfile
    from deepspeed_xla.env_file import merged_env_values
    merged = merged_env_values()
    if not merged:
        return ""
    folder = tempfile.mkdtemp(prefix="deepspeed_xla_env_")
    with open(os.path.join(folder, _ENV_FILE_NAME), "w") as handle:
        handle.writelines(f"{key}={value}\n" for key, value in merged.items())
    return folder


def runner_env_paths(original):
    """Multi-node runs: DeepSpeed's runner re-reads ``.deepspeed_env`` with a parser that fails on blank
    lines and comments; point it at a normalized copy of what deepspeed_xla already parsed."""
    folder = _normalized_env_dir()
    return [folder] if folder else original


def runner_env_name(original):
    return _ENV_FILE_NAME if _normalized_env_dir() else original
