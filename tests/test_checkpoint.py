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
