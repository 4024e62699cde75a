"""``checkpoint.write_latest``: ``latest`` changes atomically, after the tag's folder is on disk, and a failed
write leaves the old one and no temporary file. (Checkpoints written by training runs: tests/launched/.)"""
import os

import pytest

from deepspeed_xla import checkpoint


def test_latest_names_the_tag_after_its_folder_is_synced(tmp_path, monkeypatch):
    (tmp_path / "step3").mkdir()
    synced = []
    fsync = checkpoint._fsync
    monkeypatch.setattr(checkpoint, "_fsync", lambda path: (synced.append(path), fsync(path)))
    checkpoint.write_latest(str(tmp_path), "step3")
    assert (tmp_path / "latest").read_text() == "step3"
    assert synced == [str(tmp_path / "step3"), str(tmp_path)]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step3"]


def test_failed_write_keeps_the_old_latest_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    checkpoint.write_latest(str(tmp_path), "step3")

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.write_latest(str(tmp_path), "step6")
    assert (tmp_path / "latest").read_text() == "step3"
    assert os.listdir(tmp_path) == ["latest"]


def _saved(save_dir, tag: str, contents: str) -> None:
    folder = save_dir / checkpoint.saving_tag(tag)
    folder.mkdir()
    (folder / "model.pt").write_text(contents)


@pytest.mark.parametrize("swap", ["exchange", "move_aside"])
def test_promote_names_the_complete_checkpoint_and_leaves_nothing_else(tmp_path, monkeypatch, swap):
    if swap == "move_aside":  # not Linux, or a filesystem without RENAME_EXCHANGE
        monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)
    _saved(tmp_path, "last", "step 1")
    checkpoint.promote(str(tmp_path), "last")
    _saved(tmp_path, "last", "step 2")
    (tmp_path / "last" / "stale_from_step_1.pt").write_text("only in the old contents")
    checkpoint.promote(str(tmp_path), "last")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
    assert sorted(p.name for p in (tmp_path / "last").iterdir()) == ["model.pt"]
    assert (tmp_path / "last" / "model.pt").read_text() == "step 2"


def test_exchange_swaps_two_folders_in_one_step(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "from").write_text(name)
    assert checkpoint._exchange(str(tmp_path / "a"), str(tmp_path / "b"))  # Linux: the path CI takes
    assert [(tmp_path / name / "from").read_text() for name in ("a", "b")] == ["b", "a"]


def test_an_unfinished_save_is_discarded_before_the_tag_is_written_again(tmp_path):
    _saved(tmp_path, "last", "cut short")
    checkpoint.discard_unfinished(str(tmp_path), "last")
    assert not list(tmp_path.iterdir())


def test_a_cut_short_shard_names_itself_and_the_other_checkpoints(tmp_path):
    """torch's error for a truncated file names no file; DeepSpeed's load passes it on as it is."""
    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    engine = checkpoint.CpuCheckpointEngine(TorchCheckpointEngine())
    for tag in ("global_step1", "global_step2"):
        (tmp_path / tag).mkdir()
        engine.save({"w": torch.ones(64)}, str(tmp_path / tag / "shard.pt"))
    os.utime(tmp_path / "global_step1", (1, 1))  # the older one
    assert torch.equal(engine.load(str(tmp_path / "global_step1" / "shard.pt"), map_location="cpu")["w"],
                       torch.ones(64))
    shard = tmp_path / "global_step2" / "shard.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(RuntimeError) as cut:
        engine.load(str(shard), map_location="cpu")
    message = str(cut.value)
    assert f"cannot load the checkpoint file {shard}" in message and "missing or cut short" in message, message
    assert f"load_checkpoint({str(tmp_path)!r}, tag='global_step1')" in message, message
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


def test_a_full_disk_names_the_file_and_leaves_none(tmp_path):
    """A real ENOSPC from the kernel (/dev/full): torch's own writer reports it as "unexpected pos". Within a save
    of every rank the engine records it instead, for every rank to raise after the save's collectives."""
    import types
    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.model_checkpointing import CHECKPOINT_SERIALIZATION
    config = types.SimpleNamespace(checkpoint_config={CHECKPOINT_SERIALIZATION: True})  # DeepSpeed's default
    engine = checkpoint.CpuCheckpointEngine(TorchCheckpointEngine(config))
    shard = tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.symlink_to("/dev/full")
    with pytest.raises(OSError) as full:
        engine.save({"w": torch.ones(1024)}, str(shard))
    assert full.value.errno == 28
    message = f"could not write the checkpoint file {shard}: no space left on device"
    assert message in str(full.value) and "`latest` keeps naming the last complete checkpoint" in str(full.value)
    assert not list(tmp_path.iterdir())
    shard.symlink_to("/dev/full")
    with engine.deferring_write_errors() as failures:
        engine.save({"w": torch.ones(1024)}, str(shard))
    assert not list(tmp_path.iterdir())
    assert checkpoint.first_failure([[], []]) is None
    deferred = checkpoint.first_failure([[], failures])
    assert deferred.errno == 28 and message in str(deferred)
