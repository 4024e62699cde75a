"""``checkpoint``: files written from XLA hold CPU tensors, every byte of them (a write the system cuts short is
written on), with bounded host memory; a file that cannot be written, or a link in its place, is named and left
nowhere. Tags and ``latest``: tests/test_checkpoint_tags.py; checkpoints of training runs: tests/launched/."""
import errno
import os
import types

import pytest
import torch

from deepspeed_xla import checkpoint


def _engine(zipfile: bool = True):
    """DeepSpeed's default checkpoint engine as a DeepSpeed config builds it (torch's zip format unless
    ``"checkpoint": {"checkpoint_serialization": false}``), wrapped as on XLA."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.model_checkpointing import CHECKPOINT_SERIALIZATION
    config = types.SimpleNamespace(checkpoint_config={CHECKPOINT_SERIALIZATION: zipfile})
    return checkpoint.CpuCheckpointEngine(TorchCheckpointEngine(config))


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_a_cut_short_shard_names_itself_and_the_other_checkpoints(tmp_path, zipfile):
    """torch's error for a truncated file names no file; DeepSpeed's load passes it on as it is. Both formats of
    DeepSpeed's default engine (``checkpoint.save`` writes them)."""
    engine = _engine(zipfile)
    for tag in ("global_step1", "global_step2"):
        (tmp_path / tag).mkdir()
        engine.save({"w": torch.ones(64)}, str(tmp_path / tag / "shard.pt"))
    os.utime(tmp_path / "global_step1", (1, 1))  # the older one
    assert torch.equal(engine.load(str(tmp_path / "global_step1" / "shard.pt"), map_location="cpu")["w"],
                       torch.ones(64))
    shard = tmp_path / "global_step2" / "shard.pt"
    with open(shard, "rb") as file:
        assert torch.serialization._is_zipfile(file) == zipfile
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(RuntimeError) as cut:
        engine.load(str(shard), map_location="cpu")
    message = str(cut.value)
    torch_says = "failed finding central directory" if zipfile else "pickle data was truncated"
    assert f"cannot load the checkpoint file {shard}" in message and "missing or cut short" in message, message
    assert torch_says in message and f"load_checkpoint({str(tmp_path)!r}, tag='global_step1')" in message, message
    missing = tmp_path / "global_step1" / "gone.pt"
    with pytest.raises(RuntimeError, match=r"FileNotFoundError.*newest first: global_step2;"):
        engine.load(str(missing))


def _xla_state(device, sizes):
    """Pending XLA tensors (each materialized by the save) of ``sizes`` float32 elements, and a Parameter, a
    repeated tensor, a CPU tensor and a bf16 transpose around them."""
    import torch
    from collections import OrderedDict
    tensors = OrderedDict((f"t{i}", torch.full((size,), float(i)).to(device) + 1) for i, size in enumerate(sizes))
    matrix = torch.arange(12.0).reshape(3, 4).to(device)
    return {"sd": tensors, "again": tensors["t0"], "param": torch.nn.Parameter(matrix * 2), "host": torch.ones(2),
            "bf16_t": matrix.t().to(torch.bfloat16), "step": 3}


def test_save_writes_what_torch_save_writes_of_the_host_copies(tmp_path):
    """The file loads without torch_xla as before: its records are torch.save's own for the CPU copies (the
    archive's folder name aside, which torch takes from a path but not from an open file)."""
    import zipfile
    import torch
    import torch_xla
    state = _xla_state(torch_xla.device(), [5, 7])
    checkpoint.save(state, str(tmp_path / "streamed.pt"))
    torch.save(checkpoint.to_cpu(state), str(tmp_path / "copied.pt"))
    streamed, copied = (zipfile.ZipFile(tmp_path / name) for name in ("streamed.pt", "copied.pt"))
    records = [name.partition("/")[2] for name in copied.namelist()]
    assert [name.partition("/")[2] for name in streamed.namelist()] == records
    assert "data/4" in records
    for mine, theirs in zip(streamed.namelist(), copied.namelist()):
        assert streamed.read(mine) == copied.read(theirs), mine


def test_save_holds_at_most_one_batch_of_host_copies(tmp_path, monkeypatch):
    """DS_XLA_SAVE_BATCH_MB bounds the bytes of host copies alive at once; each batch is one execution and one
    transfer; a tensor above the bound is copied alone."""
    import weakref
    import torch
    import torch_xla
    from deepspeed_xla import xla_runtime
    limit = 10 * 1024
    monkeypatch.setenv(checkpoint.BATCH_ENV, str(limit / 2**20))
    sizes = [1024] * 6 + [4096] + [1024] * 2  # 4 KiB each, one of 16 KiB
    state = _xla_state(torch_xla.device(), sizes)
    alive, peak, batches = [0], [0], []
    to_host = xla_runtime.to_host

    def counted(tensors):
        hosts = to_host(tensors)
        batches.append([host.nbytes for host in hosts])
        for host in hosts:
            alive[0] += host.nbytes
            weakref.finalize(host, lambda n=host.nbytes: alive.__setitem__(0, alive[0] - n))
        peak[0] = max(peak[0], alive[0])
        return hosts

    monkeypatch.setattr(xla_runtime, "to_host", counted)
    before = xla_runtime.graph_counters()
    checkpoint.save(state, str(tmp_path / "shard.pt"))
    after = xla_runtime.graph_counters()
    tensor_bytes = [4 * size for size in sizes] + [48, 24]  # the state's own, then the Parameter and the bf16 copy
    assert sorted(sum(batches, [])) == sorted(tensor_bytes)
    assert all(sum(batch) <= limit or len(batch) == 1 for batch in batches), batches
    assert len(batches) == 5 and peak[0] == 4 * 4096 and alive[0] == 0, (batches, peak)
    assert max(sum(batch) for batch in batches if len(batch) > 1) <= limit < sum(tensor_bytes)
    assert after["executions"] - before["executions"] == len(batches)
    assert after["transfers_to_host"] - before["transfers_to_host"] == len(batches)
    loaded = torch.load(tmp_path / "shard.pt", weights_only=False)
    assert [t.tolist() for t in loaded["sd"].values()] == [[i + 1.0] * size for i, size in enumerate(sizes)]
    assert loaded["again"] is loaded["sd"]["t0"] and isinstance(loaded["param"], torch.nn.Parameter)


class _ShortWrites(checkpoint._File):
    """The file as Linux hands it over past 0x7ffff000 bytes a call, at a small scale: a write writes at most 1000
    bytes and returns that count, as ``io.FileIO.write`` does."""

    def write(self, data) -> int:
        return super().write(memoryview(data).cast("B")[:1000])


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_a_write_the_system_cuts_short_is_written_on(tmp_path, monkeypatch, zipfile):
    """torch's zip writer and the pickler call ``write`` once per record and ignore its count: without writing on,
    the file would lose all but 1000 bytes of each record and save without a word. Both formats of the default
    engine, XLA tensors fetched in batches (zip) or at once (legacy), CPU tensors and the pickled objects."""
    import torch_xla
    monkeypatch.setattr(checkpoint, "_File", _ShortWrites)
    monkeypatch.setenv(checkpoint.BATCH_ENV, str(4096 / 2**20))
    state = _xla_state(torch_xla.device(), [3000, 500, 2000])
    state["host_big"], state["text"] = torch.arange(5000.0), "x" * 3000
    _engine(zipfile).save(state, str(tmp_path / "shard.pt"))
    loaded = torch.load(tmp_path / "shard.pt", weights_only=False)
    expected = checkpoint.to_cpu(state)
    for key in ("again", "param", "host", "bf16_t", "host_big"):
        assert torch.equal(loaded[key], expected[key]), key
    assert all(torch.equal(loaded["sd"][name], expected["sd"][name]) for name in expected["sd"])
    assert loaded["step"] == 3 and loaded["text"] == "x" * 3000


def _save_through_deepspeeds_python_writer(state: dict, path: str) -> None:
    """As DeepSpeed's fast and decoupled checkpoint engines with ``"writer": {"type": "python"}`` save (the other
    writer type needs the async_io op, which XLA lacks)."""
    from deepspeed.io.py_file_writer import PyFileWriter
    writer = PyFileWriter(path)
    torch.save(state, writer)
    writer.close()


@pytest.mark.parametrize("save", [checkpoint.save, _save_through_deepspeeds_python_writer],
                         ids=["checkpoint.save", "deepspeed_python_writer"])
def test_a_tensor_over_2_gib_is_saved_whole(tmp_path, save):
    """Linux writes at most 0x7ffff000 bytes in one call: one tensor over 2 GiB (a ZeRO partition or Adam moment of a
    7B model at 8 ranks) lost its last bytes, and the file did not load. 2.1 GiB of int8, saved, loaded
    memory-mapped and compared; the file is removed."""
    size = int(2.1 * 2**30)
    tensor = torch.zeros(size, dtype=torch.int8)
    tensor[::4096] = 1
    tensor[-7:] = torch.arange(7, dtype=torch.int8) + 2  # the bytes a cut-short write loses first
    path = tmp_path / "big.pt"
    try:
        save({"moments": tensor, "step": 9}, str(path))
        loaded = torch.load(path, mmap=True, weights_only=False)
        assert loaded["step"] == 9 and loaded["moments"].shape == (size, )
        assert torch.equal(loaded["moments"], tensor)
        del loaded
    finally:
        path.unlink(missing_ok=True)


class _FullAfter(checkpoint._File):
    """A disk that fills while the file is written: writes go through until 3000 bytes are in the file (the last one
    cut short), then fail with the kernel's ENOSPC, kept as ``_File`` keeps it."""

    def write(self, data) -> int:
        room = 3000 - self.tell()
        if room <= 0:
            self.error = self.error or OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            raise self.error
        return super().write(memoryview(data).cast("B")[:room])


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_a_disk_that_fills_while_saving_names_the_file_and_leaves_none(tmp_path, monkeypatch, zipfile):
    """The disk fills part-way through the file: the save stops naming it and removes what it wrote. Within a save of
    every rank the engine records the error instead, for every rank to raise after the save's collectives."""
    monkeypatch.setattr(checkpoint, "_File", _FullAfter)
    engine = _engine(zipfile)
    shard = tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with pytest.raises(OSError) as full:
        engine.save({"w": torch.ones(4096)}, str(shard))
    assert full.value.errno == errno.ENOSPC
    message = f"could not write the checkpoint file {shard}: no space left on device"
    assert message in str(full.value) and "`latest` keeps naming the last complete checkpoint" in str(full.value)
    assert not list(tmp_path.iterdir())
    with engine.deferring_write_errors() as failures:
        engine.save({"w": torch.ones(4096)}, str(shard))
    assert not list(tmp_path.iterdir())
    assert checkpoint.first_failure([[], []]) is None
    deferred = checkpoint.first_failure([[], failures])
    assert deferred.errno == errno.ENOSPC and message in str(deferred)


def test_a_link_in_place_of_the_file_is_not_written_through(tmp_path):
    """A link left where a checkpoint file goes (by someone who could write to that folder) is refused, naming it;
    the file it points to keeps its contents."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    shard = tmp_path / "mp_rank_00_model_states.pt"
    shard.symlink_to(victim)
    with pytest.raises(OSError) as refused:
        _engine().save({"w": torch.ones(4)}, str(shard))
    assert refused.value.errno == errno.ELOOP
    assert f"did not write the checkpoint file {shard}: it is a symbolic link" in str(refused.value)
    assert victim.read_text() == "precious" and shard.is_symlink()


def test_files_get_the_mode_open_would_give(tmp_path):
    """Made without following links, the files still take their mode from the umask, as ``open()``'s do: a group
    that shares checkpoints (umask 002) keeps its write permission."""
    from deepspeed_xla import checkpoint_tags
    previous = os.umask(0o002)
    try:
        _engine().save({"w": torch.ones(4)}, str(tmp_path / "shard.pt"))
        checkpoint_tags.write_latest(str(tmp_path), "global_step1")
    finally:
        os.umask(previous)
    assert [oct(os.stat(tmp_path / name).st_mode & 0o777) for name in ("shard.pt", "latest")] == [oct(0o664)] * 2
