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
