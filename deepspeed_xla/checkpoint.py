"""Checkpoint files written from XLA: CPU tensors only, every byte written, flushed to disk.

DeepSpeed hands its checkpoint engine state dicts that hold XLA tensors. ``torch.save`` pickles those
as "CPU data, rebuild on xla:0", so the files need torch_xla to load (and fail with DeepSpeed's own
callable ``map_location``). It also copies each one to the host while pickling and keeps every copy until
the archive is written: the whole file in host memory. ``save`` writes the same file as ``torch.save`` of
the tensors' CPU copies, but fetches them from the device in batches of at most ``DS_XLA_SAVE_BATCH_MB``
while their records are written, so one batch of host copies is alive at a time.

torch's writers (the zip writer, the pickler) call ``write`` once per record and ignore the count it returns, and
Linux writes at most 0x7ffff000 bytes per ``write``: every file here goes through ``_Complete``, which writes all.
Tags and ``latest``: ``checkpoint_tags``.
"""
import collections
import contextlib
import copy
import errno
import io
import os
import pickle
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from deepspeed_xla import checkpoint_tags, env_vars, xla_runtime

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
    """The checkpoint file, opened without following a symbolic link (an existing file is truncated); keeps the OS
    error of a failed write, which torch's writer reports only as "unexpected pos". One ``write`` is one system call,
    which may write less than it was given."""
    error: Optional[OSError] = None

    def __init__(self, path: str):
        # 0o666: the umask decides the mode, as for open()
        super().__init__(path, "w", opener=lambda name, flags: os.open(name, flags | os.O_NOFOLLOW, 0o666))

    def write(self, data) -> int:
        try:
            return super().write(data)
        except OSError as error:
            self.error = self.error or error
            raise


class _Complete:
    """What torch's writers are handed: each ``write`` writes every byte, calling the file's until it has. torch's zip
    writer and the pickler ignore the count ``write`` returns, and Linux writes at most 0x7ffff000 bytes in one call:
    a tensor of 2 GiB or more would leave a hole in the file, and no error. No ``fileno``: torch writes through here
    rather than to the descriptor."""

    def __init__(self, file: _File):
        self._file = file

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            written = self._file.write(view[done:])
            if not written:
                self._file.error = OSError(errno.EIO, "the system wrote nothing")
                raise self._file.error
            done += written
        return done

    def flush(self) -> None:
        self._file.flush()


def _rank() -> str:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return f"rank {torch.distributed.get_rank()}"
    return "this process"


def save(state: Any, path: str, zipfile: bool = True) -> None:
    """``torch.save(state, path)`` with XLA tensors written as CPU tensors; the file is flushed to disk. A failed write
    removes the file and names it. ``zipfile``: torch's default format, written with at most ``batch_bytes()`` of host
    copies at once; else torch's legacy format (``_use_new_zipfile_serialization=False``), copied to the host at
    once."""
    placeholders: List[_OnDevice] = []
    try:
        handle = _File(path)
    except OSError as error:
        raise _write_error(path, error.errno) from error
    try:
        if zipfile:
            with torch.serialization._open_zipfile_writer(_Complete(handle)) as writer:
                torch.serialization._save(state, _BatchedRecords(writer, placeholders, batch_bytes()),
                                          _pickle_module(placeholders), torch.serialization.DEFAULT_PROTOCOL, False)
        else:
            torch.save(to_cpu(state), _Complete(handle), _use_new_zipfile_serialization=False)
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
    if code == errno.ELOOP:
        return OSError(code, f"deepspeed_xla: {_rank()} did not write the checkpoint file {path}: it is a symbolic "
                             "link, and checkpoint files are never written through one (left there by someone else, "
                             "it could point anywhere). Remove it; if other users can write to that folder, save to "
                             "one only you can write.")
    return OSError(code, f"deepspeed_xla: {_rank()} could not write the checkpoint file {path}: "
                         f"{os.strerror(code).lower()}. The file is removed and this save is abandoned: `latest` "
                         "keeps naming the last complete checkpoint. Free space there, or save to another save_dir.")


def _torch_save_format(engine) -> Optional[bool]:
    """Whether DeepSpeed's default engine (a ``torch.save``) writes torch's zip format; None for any other engine."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    return bool(engine.zipfile_serialization) if type(engine).save is TorchCheckpointEngine.save else None


class CpuCheckpointEngine:
    """DeepSpeed's checkpoint engine, handed CPU state dicts; written files are flushed to disk.

    Everything but ``save`` goes to the wrapped engine. DeepSpeed's default engine (a ``torch.save``) is
    replaced by ``save``, which bounds the host copies in torch's default format; other engines take the whole
    state dict, copied to the host at once. Storage sharing is not preserved (each tensor's copy is separate),
    so DeepSpeed skips its own per-tensor clone before saving.
    """

    def __init__(self, engine):
        self._engine = engine
        self._deferred: Optional[List[Tuple[int, str]]] = None
        self._before_writes: Callable[[], List[Tuple[int, str]]] = list

    def __getattr__(self, name):
        return getattr(self._engine, name)

    @contextlib.contextmanager
    def deferring_write_errors(self, before_writes: Callable[[], List[Tuple[int, str]]] = list):
        """Around a save that every rank runs: a file this rank cannot write (a full disk) is recorded, not
        raised, so the rank goes on through the save's collectives with the others; each rank then raises
        the first one (``first_failure``). Raised at once, it would leave the others waiting in a barrier.
        ``before_writes``: the errors of a check run once every rank has passed the save's first barrier
        (``create``)."""
        self._deferred, self._before_writes = [], before_writes
        try:
            yield self._deferred
        finally:
            self._deferred, self._before_writes = None, list

    def create(self, info):
        """DeepSpeed calls this after the save's first barrier, before any rank writes a file."""
        if self._deferred is not None:
            self._deferred += self._before_writes()
        return self._engine.create(info)

    def hold(self, error: OSError) -> None:
        """Record ``error`` for every rank to raise after the save (``deferring_write_errors``); outside one, raise."""
        if self._deferred is None:
            raise error
        self._deferred.append((error.errno, error.strerror))

    def save(self, state_dict, path: str):
        zipfile = _torch_save_format(self._engine)
        if zipfile is not None:
            try:
                return save(state_dict, path, zipfile)
            except OSError as error:
                return self.hold(error)
        result = self._engine.save(to_cpu(state_dict), path)
        if not self._engine.is_decoupled() and os.path.isfile(path):
            checkpoint_tags.fsync(path)
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
                               f"copy). {checkpoint_tags.other_checkpoints(tag_dir)}") from error

    def preserves_storage_sharing(self) -> bool:
        return False


def first_failure(failures_per_rank: Sequence[Sequence[Tuple[int, str]]]) -> Optional[OSError]:
    """The error of the lowest rank that recorded one (``deferring_write_errors``, ``hold``), if any."""
    first = next((failure for failures in failures_per_rank for failure in failures), None)
    return None if first is None else OSError(*first)
