"""Checkpoints written from XLA: CPU tensors only, and ``latest`` names only complete checkpoints.

DeepSpeed hands its checkpoint engine state dicts that hold XLA tensors. ``torch.save`` pickles those
as "CPU data, rebuild on xla:0", so the files need torch_xla to load (and fail with DeepSpeed's own
callable ``map_location``). It also copies each one to the host while pickling and keeps every copy until
the archive is written: the whole file in host memory. ``save`` writes the same file as ``torch.save`` of
the tensors' CPU copies, but fetches them from the device in batches of at most ``DS_XLA_SAVE_BATCH_MB``
while their records are written, so one batch of host copies is alive at a time.

DeepSpeed's rank 0 writes ``latest`` right after its own files, while other ranks may still be writing
theirs, and rewrites it in place: a rank killed during a save can leave ``latest`` naming an
incomplete checkpoint, or empty. Here ``latest`` is replaced atomically once every rank's files are
written and flushed. A tag is written aside (``<tag>.saving``) and takes the tag's name only when it is
complete, so saving a tag again (a "last" or "best" checkpoint) never leaves it half old, half new.
"""
import collections
import contextlib
import copy
import ctypes
import errno
import io
import os
import pickle
import shutil
import types
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from deepspeed_xla import env_vars, xla_runtime

LATEST = "latest"
SAVING_SUFFIX = ".saving"
REPLACED_SUFFIX = ".replaced"  # an old tag moved aside where folders cannot be swapped
BATCH_ENV = "DS_XLA_SAVE_BATCH_MB"
DEFAULT_BATCH_MB = 256


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


def batch_bytes() -> int:
    """The most bytes of host copies a save holds at once (``DS_XLA_SAVE_BATCH_MB``, megabytes)."""
    megabytes = env_vars.positive_number(os.environ, BATCH_ENV, "a size in megabytes such as 256")
    return max(1, int((megabytes or DEFAULT_BATCH_MB) * 2**20))


def _contiguous_strides(shape: torch.Size) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _OnDevice:
    """Stands where torch's writer expects an XLA tensor's CPU storage: its bytes are fetched when its record is
    written. The device is "cpu" because the file's tensors are CPU tensors (torch writes them as they are)."""
    device = torch.device("cpu")

    def __init__(self, tensor: torch.Tensor, index: int):
        self.tensor, self.index = tensor, index
        self._cdata = id(self)  # torch keys storages by ``_cdata``: one record per placeholder

    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def data_ptr(self) -> int:
        return 0  # no host data: torch's check that one buffer is not saved as two dtypes skips it


def _pickle_module(placeholders: List[_OnDevice]) -> Any:
    """A pickle module whose Pickler writes a plain XLA tensor as torch writes its contiguous CPU copy,
    over a placeholder storage; other objects (Parameters, CPU tensors) pickle as torch pickles them."""

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            if type(obj) is not torch.Tensor or obj.device.type != "xla":
                return NotImplemented
            storage = torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(0), dtype=obj.dtype,
                                                 _internal=True)
            storage._untyped_storage = _OnDevice(obj, len(placeholders))
            placeholders.append(storage._untyped_storage)
            return (torch._utils._rebuild_tensor_v2, (storage, 0, tuple(obj.size()), _contiguous_strides(obj.size()),
                                                      obj.requires_grad, collections.OrderedDict()))

    return types.SimpleNamespace(Pickler=Pickler)


class _BatchedRecords:
    """torch's zip writer, handed each placeholder's bytes as its record is written. torch writes the records in
    the order the pickler made the placeholders, so they are fetched in that order, a batch at a time (one
    execution and one transfer per batch; a tensor above the limit alone)."""

    def __init__(self, writer, placeholders: List[_OnDevice], limit: int):
        self._writer, self._placeholders, self._limit = writer, placeholders, limit
        self._hosts: Dict[int, torch.Tensor] = {}

    def __getattr__(self, name):
        return getattr(self._writer, name)

    def write_record(self, name: str, data, size: int) -> None:
        if isinstance(data, _OnDevice):
            if data.index not in self._hosts:
                self._fetch(data.index)
            data = self._hosts.pop(data.index).untyped_storage()
        self._writer.write_record(name, data, size)

    def _fetch(self, first: int) -> None:
        batch, total = [], 0
        for placeholder in self._placeholders[first:]:
            if batch and total + placeholder.nbytes() > self._limit:
                break
            batch.append(placeholder)
            total += placeholder.nbytes()
        hosts = xla_runtime.to_host([placeholder.tensor for placeholder in batch])
        self._hosts.update((placeholder.index, host) for placeholder, host in zip(batch, hosts))


class _File(io.FileIO):
    """The checkpoint file: keeps the OS error of a failed write, which torch's writer reports only as
    "unexpected pos"."""
    error: Optional[OSError] = None

    def write(self, data) -> int:
        try:
            return super().write(data)
        except OSError as error:
            self.error = self.error or error
            raise


def _rank() -> str:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return f"rank {torch.distributed.get_rank()}"
    return "this process"


def save(state: Any, path: str) -> None:
    """``torch.save(state, path)`` with XLA tensors written as CPU tensors, at most ``batch_bytes()`` of them in
    host memory at once; the file is flushed to disk. A failed write removes the file and names it."""
    placeholders: List[_OnDevice] = []
    try:
        handle = _File(path, "w")
    except OSError as error:
        raise _write_error(path, error.errno) from error
    try:
        with torch.serialization._open_zipfile_writer(handle) as writer:
            torch.serialization._save(state, _BatchedRecords(writer, placeholders, batch_bytes()),
                                      _pickle_module(placeholders), torch.serialization.DEFAULT_PROTOCOL, False)
        os.fsync(handle.fileno())
    except BaseException as error:
        handle.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        if handle.error is None:
            raise
        raise _write_error(path, handle.error.errno) from error
    handle.close()


def _write_error(path: str, code: int) -> OSError:
    return OSError(code, f"deepspeed_xla: {_rank()} could not write the checkpoint file {path}: "
                         f"{os.strerror(code).lower()}. The file is removed and this save is abandoned: `latest` "
                         "keeps naming the last complete checkpoint. Free space there, or save to another save_dir.")


def _fsync(path: str) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else os.O_RDONLY
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writes_with_torch_save(engine) -> bool:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    return type(engine).save is TorchCheckpointEngine.save and engine.zipfile_serialization


class CpuCheckpointEngine:
    """DeepSpeed's checkpoint engine, handed CPU state dicts; written files are flushed to disk.

    Everything but ``save`` goes to the wrapped engine. DeepSpeed's default engine (a ``torch.save``) is
    replaced by ``save``, which bounds the host copies; other engines take the whole state dict, copied
    to the host at once. Storage sharing is not preserved (each tensor's copy is separate), so DeepSpeed
    skips its own per-tensor clone before saving.
    """

    def __init__(self, engine):
        self._engine = engine
        self._deferred: Optional[List[Tuple[int, str]]] = None

    def __getattr__(self, name):
        return getattr(self._engine, name)

    @contextlib.contextmanager
    def deferring_write_errors(self):
        """Around a save that every rank runs: a file this rank cannot write (a full disk) is recorded, not
        raised, so the rank goes on through the save's collectives with the others; each rank then raises
        the first one (``first_failure``). Raised at once, it would leave the others waiting in a barrier."""
        self._deferred = []
        try:
            yield self._deferred
        finally:
            self._deferred = None

    def save(self, state_dict, path: str):
        if _writes_with_torch_save(self._engine):
            try:
                return save(state_dict, path)
            except OSError as error:
                if self._deferred is None:
                    raise
                self._deferred.append((error.errno, error.strerror))
                return None
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


def first_failure(failures_per_rank: Sequence[Sequence[Tuple[int, str]]]) -> Optional[OSError]:
    """The error of the lowest rank whose file was not written (``deferring_write_errors``), if any."""
    first = next((failure for failures in failures_per_rank for failure in failures), None)
    return None if first is None else OSError(*first)


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
