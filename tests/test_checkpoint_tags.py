"""``checkpoint_tags``: ``latest`` changes atomically, after the tag's folder is on disk; a tag appears whole; a save
that stopped between the two renames of the move-aside path still loads; nothing follows a link left in ``save_dir``.
(Checkpoints written by training runs: tests/launched/.)"""
import os
import stat

import pytest

from deepspeed_xla import checkpoint_tags, mounts


def test_latest_names_the_tag_after_its_folder_is_synced(tmp_path, monkeypatch):
    (tmp_path / "step3").mkdir()
    synced = []
    fsync = checkpoint_tags.fsync
    monkeypatch.setattr(checkpoint_tags, "fsync", lambda path: (synced.append(path), fsync(path)))
    checkpoint_tags.write_latest(str(tmp_path), "step3")
    assert (tmp_path / "latest").read_text() == "step3"
    assert synced == [str(tmp_path / "step3"), str(tmp_path)]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step3"]


def test_write_latest_replaces_the_tag_atomically(tmp_path):
    """A reader that opened ``latest`` before the write reads the old tag whole, a new reader the new one: the new
    tag is a new file renamed over the old, never the old file truncated and rewritten (DeepSpeed's in-place write,
    which a reader or a crash sees empty or half written)."""
    checkpoint_tags.write_latest(str(tmp_path), "global_step1")
    with open(tmp_path / "latest", encoding="utf-8") as before:
        checkpoint_tags.write_latest(str(tmp_path), "global_step22")
        assert before.read() == "global_step1"
    assert (tmp_path / "latest").read_text() == "global_step22"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


@pytest.mark.parametrize("fails", ["write", "replace"])
def test_failed_write_keeps_the_old_latest_and_leaves_no_temporary_file(tmp_path, monkeypatch, fails):
    checkpoint_tags.write_latest(str(tmp_path), "step3")

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    if fails == "write":  # the temporary file is made, then its write fails
        monkeypatch.setattr(os, "fsync", disk_full)
    else:
        monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint_tags.write_latest(str(tmp_path), "step6")
    assert (tmp_path / "latest").read_text() == "step3"
    assert os.listdir(tmp_path) == ["latest"]


def test_latest_is_not_written_through_a_link_left_as_its_temporary_file(tmp_path):
    """Someone who could write to ``save_dir`` left ``latest.tmp.<pid>`` as a link to a file of the user's: the link
    is replaced, the file it points to is left as it was."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (save_dir / f"latest.tmp.{os.getpid()}").symlink_to(victim)
    checkpoint_tags.write_latest(str(save_dir), "global_step1")
    assert victim.read_text() == "precious"
    assert (save_dir / "latest").read_text() == "global_step1" and not (save_dir / "latest").is_symlink()
    assert sorted(p.name for p in save_dir.iterdir()) == ["latest"]


def _saved(save_dir, tag: str, contents: str) -> None:
    folder = save_dir / checkpoint_tags.saving_tag(tag)
    folder.mkdir()
    (folder / "model.pt").write_text(contents)


@pytest.mark.parametrize("swap", ["exchange", "move_aside"])
def test_promote_names_the_complete_checkpoint_and_leaves_nothing_else(tmp_path, monkeypatch, swap):
    if swap == "move_aside":  # not Linux, or a filesystem without RENAME_EXCHANGE
        monkeypatch.setattr(checkpoint_tags, "_exchange", lambda a, b: False)
    _saved(tmp_path, "last", "step 1")
    checkpoint_tags.promote(str(tmp_path), "last")
    _saved(tmp_path, "last", "step 2")
    (tmp_path / "last" / "stale_from_step_1.pt").write_text("only in the old contents")
    checkpoint_tags.promote(str(tmp_path), "last")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
    assert sorted(p.name for p in (tmp_path / "last").iterdir()) == ["model.pt"]
    assert (tmp_path / "last" / "model.pt").read_text() == "step 2"


def test_a_save_stopped_between_the_two_renames_loads_the_checkpoint_moved_aside(tmp_path, monkeypatch):
    """The move-aside path (no RENAME_EXCHANGE) stopped after moving the old tag aside: ``latest`` names a missing
    tag, ``<tag>.replaced`` holds the complete checkpoint it named. A load takes that one, saying so; the next save
    of the tag names its new checkpoint and removes the old one."""
    monkeypatch.setattr(checkpoint_tags, "_exchange", lambda a, b: False)
    _saved(tmp_path, "last", "step 1")
    checkpoint_tags.promote(str(tmp_path), "last")
    checkpoint_tags.write_latest(str(tmp_path), "last")
    _saved(tmp_path, "last", "step 2")
    rename = os.rename

    def crash_before_the_second(source, target):
        rename(source, target)
        if target.endswith(checkpoint_tags.REPLACED_SUFFIX):
            raise KeyboardInterrupt("killed between the two renames")

    monkeypatch.setattr(os, "rename", crash_before_the_second)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_tags.promote(str(tmp_path), "last")
    monkeypatch.setattr(os, "rename", rename)
    assert not (tmp_path / "last").exists()
    with pytest.warns(RuntimeWarning, match=r"last is missing, and .*last.replaced holds the one it replaced"):
        tag = checkpoint_tags.loadable_tag(str(tmp_path), (tmp_path / "latest").read_text())
    assert (tmp_path / tag / "model.pt").read_text() == "step 1"
    assert checkpoint_tags.loadable_tag(str(tmp_path), "another") == "another"  # nothing aside: as asked

    checkpoint_tags.discard_unfinished(str(tmp_path), "last")
    _saved(tmp_path, "last", "step 3")
    checkpoint_tags.promote(str(tmp_path), "last")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "latest"]
    assert checkpoint_tags.loadable_tag(str(tmp_path), "last") == "last"


def test_exchange_swaps_two_folders_in_one_step(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "from").write_text(name)
    assert checkpoint_tags._exchange(str(tmp_path / "a"), str(tmp_path / "b"))  # Linux: the path CI takes
    assert [(tmp_path / name / "from").read_text() for name in ("a", "b")] == ["b", "a"]


def test_an_unfinished_save_is_discarded_before_the_tag_is_written_again(tmp_path):
    _saved(tmp_path, "last", "cut short")
    checkpoint_tags.discard_unfinished(str(tmp_path), "last")
    assert not list(tmp_path.iterdir())


def test_a_link_left_as_the_unfinished_tag_is_removed_not_followed(tmp_path):
    """``<tag>.saving`` left as a link to another folder: the save would write its files there. The link goes, the
    folder it points to keeps its files."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("kept")
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (save_dir / checkpoint_tags.saving_tag("last")).symlink_to(elsewhere, target_is_directory=True)
    checkpoint_tags.discard_unfinished(str(save_dir), "last")
    assert not list(save_dir.iterdir())
    assert (elsewhere / "keep").read_text() == "kept"


@pytest.mark.parametrize("mode, refused", [(0o777, True), (0o1777, False), (0o775, False), (0o700, False)])
def test_a_save_dir_every_user_may_write_to_is_refused_without_the_sticky_bit(tmp_path, mode, refused):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    for save_dir in (shared, shared / "not_made_yet" / "ckpt"):  # not made yet: the folder it will be made in
        if not refused:
            checkpoint_tags.check_save_dir(str(save_dir))
            continue
        with pytest.raises(PermissionError) as error:
            checkpoint_tags.check_save_dir(str(save_dir))
        assert (f"every user may write to the checkpoint folder {shared} (mode 777, no sticky bit)" in str(error.value)
                and f"Run `chmod o-w {shared}` (or `chmod +t {shared}`)" in str(error.value)), str(error.value)
    assert stat.S_IMODE(shared.stat().st_mode) == mode


def test_a_save_dir_on_a_filesystem_that_renames_folders_file_by_file_is_refused(tmp_path, monkeypatch):
    """gcsfuse without hierarchical namespace: a checkpoint's rename to its tag copies file by file."""
    save_dir = tmp_path / "ckpt"
    info = tmp_path / "mountinfo"
    info.write_text(f"22 1 252:1 / / rw - ext4 /dev/vda1 rw\n30 22 0:52 / {tmp_path} rw - fuse.gcsfuse flat rw\n")
    monkeypatch.setattr(mounts, "MOUNTINFO", str(info))
    monkeypatch.delenv(mounts.ATOMIC_RENAMES_ENV, raising=False)
    with pytest.raises(OSError) as error:
        checkpoint_tags.check_save_dir(str(save_dir))
    assert (f"deepspeed_xla: the checkpoint folder {tmp_path} is on fuse.gcsfuse (flat mounted at {tmp_path})"
            in str(error.value) and f"set {mounts.ATOMIC_RENAMES_ENV}=1" in str(error.value)), str(error.value)
    monkeypatch.setenv(mounts.ATOMIC_RENAMES_ENV, "1")  # a bucket with hierarchical namespace
    checkpoint_tags.check_save_dir(str(save_dir))
