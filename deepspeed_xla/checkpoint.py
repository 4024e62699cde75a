"""Checkpoints written from XLA: CPU tensors only, and ``latest`` names only complete checkpoints.

DeepSpeed hands its checkpoint engine state dicts that hold XLA tensors. ``torch.save`` pickles those
as "CPU data, rebuild on xla:0", so the files need torch_xla to load (and fail with DeepSpeed's own
callable ``map_location``); here every XLA tensor is copied to the host first, all with one execution.

DeepSpeed's rank 0 writes ``latest`` right after its own files, while other ranks may still be writing
theirs, and rewrites it in place: a rank killed during a save can leave ``latest`` naming an
incomplete checkpoint, or empty. Here ``latest`` is replaced atomically once every rank's files are
written and flushed. A tag is written aside (``<tag>.saving``) and takes the tag's name only when it is
complete, so saving a tag again (a "last" or "best" checkpoint) never leaves it half old, half new.
"""
import contextlib
import copy
import ctypes
import errno
import os
import pickle
import shutil
from typing import Any, Dict

import torch

from deepspeed_xla import xla_runtime

LATEST = "latest"
SAVING_SUFFIX = ".saving"
REPLACED_SUFFIX = ".replaced"  # an old tag moved aside where folders cannot be swapped


def _map_tensors(obj: Any, convert) -> Any:
    """``obj`` with ``convert`` applied to every tensor in its dicts, lists and tuples.

    Containers without a converted tensor are returned as they are (``torch.Size`` stays a ``torch.Size``).
    """
    if torch.is_tensor(obj):
        return convert(obj)
    if isinstance(obj, dict):
        items = {key: _map_tensors(value, convert) for key, value in obj.items()}
        if all(items[key] is value for key, value in obj.items()):
            return obj
        out = copy.copy(obj)  # keeps the mapping type (OrderedDict, ...)
        out.update(items)
        return out
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(value, convert) for value in obj]
        if all(new is old for new, old in zip(items, obj)):
            return obj
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _host_copy(tensor: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(host, requires_grad=tensor.requires_grad)
    return host.requires_grad_(tensor.requires_grad) if host.is_floating_point() else host


def to_cpu(state: Any) -> Any:
    """``state`` with CPU copies of its XLA tensors (one device execution for all of them).

    A tensor that appears more than once stays one object, as ``torch.save`` would keep it.
    """
    on_device: Dict[int, torch.Tensor] = {}

    def collect(tensor):
        if tensor.device.type == "xla":
            on_device[id(tensor)] = tensor
        return tensor

    _map_tensors(state, collect)
    if not on_device:
        return state
    tensors = list(on_device.values())
    hosts = {id(t): _host_copy(t, h) for t, h in zip(tensors, xla_runtime.to_host(tensors))}
    return _map_tensors(state, lambda t: hosts.get(id(t), t))


def _fsync(path: str) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else os.O_RDONLY
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CpuCheckpointEngine:
    """DeepSpeed's checkpoint engine, handed CPU state dicts; written files are flushed to disk.

    Everything but ``save`` goes to the wrapped engine. Storage sharing is not preserved (the host
    copies are separate tensors), so DeepSpeed skips its own per-tensor clone before saving.
    """

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def save(self, state_dict, path: str):
        result = self._engine.save(to_cpu(state_dict), path)
        if not self._engine.is_decoupled() and os.path.isfile(path):
            _fsync(path)
        return result

    def load(self, path: str, map_location=None):
        """The wrapped engine's load; a missing or cut-short file names itself and the other checkpoints.

        torch's own error for a truncated file ("failed finding central directory") names no file."""
        try:
            return self._engine.load(path, map_location=map_location)
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as error:
            tag_dir = os.path.dirname(path)
            raise RuntimeError(f"deepspeed_xla: cannot load the checkpoint file {path} ({type(error).__name__}: "
                               f"{error}): it is missing or cut short (a save that did not finish, an incomplete "
                               f"copy). {_other_checkpoints(tag_dir)}") from error

    def preserves_storage_sharing(self) -> bool:
        return False


def _other_checkpoints(tag_dir: str) -> str:
    """The other complete-looking tags beside ``tag_dir``, newest first, as advice."""
    save_dir, tag = os.path.split(os.path.normpath(tag_dir))
    try:
        others = [entry for entry in os.scandir(save_dir) if entry.is_dir() and entry.name != tag
                  and not entry.name.endswith((SAVING_SUFFIX, REPLACED_SUFFIX))]
    except OSError:
        return ""
    if not others:
        return f"{save_dir} holds no other checkpoint."
    names = [entry.name for entry in sorted(others, key=lambda entry: entry.stat().st_mtime, reverse=True)]
    return (f"Other checkpoints in {save_dir}, newest first: {', '.join(names)}; load one with "
            f"load_checkpoint({save_dir!r}, tag={names[0]!r}).")


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``save_dir/latest`` at ``tag`` atomically: readers see the old tag or the new one, never a part.
    The tag's folder entries reach the disk first; a failed write leaves the old ``latest`` and no temporary file."""
    tag_dir = os.path.join(save_dir, str(tag))
    if os.path.isdir(tag_dir):
        _fsync(tag_dir)
    path = os.path.join(save_dir, LATEST)
    staging = f"{path}.tmp.{os.getpid()}"
    try:
        with open(staging, "w") as handle:
            handle.write(tag)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise
    _fsync(save_dir)


def saving_tag(tag: str) -> str:
    """The folder a checkpoint under ``tag`` is written into until every rank's files are complete."""
    return f"{tag}{SAVING_SUFFIX}"


def discard_unfinished(save_dir: str, tag: str) -> None:
    """Remove what an interrupted save under ``tag`` left, before the tag is written again."""
    shutil.rmtree(os.path.join(save_dir, saving_tag(tag)), ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
    """Swap two folders in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), a, None, b)


def promote(save_dir: str, tag: str) -> None:
    """Give the complete checkpoint in ``saving_tag(tag)`` the name ``tag``.

    A tag saved before is swapped with it in one step: a reader, or a crash, finds the old contents or
    the new ones. Where folders cannot be swapped (not Linux, some network filesystems) the old one
    is moved aside first, and for that moment the tag is missing (docs/checkpoints.md).
    """
    final, incoming = os.path.join(save_dir, tag), os.path.join(save_dir, saving_tag(tag))
    _fsync(incoming)
    if not os.path.exists(final):
        os.rename(incoming, final)
    elif not _exchange(incoming, final):
        aside = f"{final}{REPLACED_SUFFIX}"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        os.rename(incoming, final)
        incoming = aside
    shutil.rmtree(incoming, ignore_errors=True)  # the old contents, after a swap
    _fsync(os.path.dirname(final))
