"""Which mount holds a path, read from a mountinfo file written here in the kernel's format (proc(5))."""
import pytest

from deepspeed_xla import mounts

ROOT = "22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw"


def _mountinfo(tmp_path, *lines: str) -> str:
    path = tmp_path / "mountinfo"
    path.write_text("\n".join((ROOT, ) + lines) + "\n")
    return str(path)


def test_the_longest_mount_point_holding_the_path_wins_and_escapes_are_read(tmp_path):
    info = _mountinfo(tmp_path, "30 22 0:52 / /mnt rw - nfs4 filer:/export rw",
                      r"31 30 0:53 / /mnt/my\040bucket rw,nosuid,nodev - fuse.gcsfuse my-bucket rw,user_id=0",
                      "32 30 0:54 / /mnt/my rw - tmpfs tmpfs rw")
    assert mounts.mount_of("/mnt/my bucket/ckpt/not_made_yet", info) == ("/mnt/my bucket", "fuse.gcsfuse", "my-bucket")
    assert mounts.mount_of("/mnt/my", info).fstype == "tmpfs"
    assert mounts.mount_of("/mnt/mybucket", info).fstype == "nfs4"  # a prefix of the name is not the folder
    assert mounts.mount_of("/home/user", info).point == "/"


def test_a_later_mount_over_the_same_point_hides_the_earlier_one(tmp_path):
    info = _mountinfo(tmp_path, "30 22 0:52 / /ckpt rw - fuse.gcsfuse flat-bucket rw",
                      "31 30 0:53 / /ckpt rw - ext4 /dev/vdb rw")
    assert mounts.mount_of("/ckpt/run", info).fstype == "ext4"


@pytest.mark.parametrize("fstype, refused, other_way", [("fuse.gcsfuse", True, "hierarchical namespace"),
                                                        ("fuse.s3fs", True, None), ("fuse.rclone", True, None),
                                                        ("nfs4", False, None), ("ext4", False, None)])
def test_filesystems_that_rename_folders_file_by_file_are_named_with_the_fix(tmp_path, fstype, refused, other_way):
    info = _mountinfo(tmp_path, f"30 22 0:52 / /ckpt rw - {fstype} bucket rw")
    problem = mounts.copying_rename_problem("/ckpt/run", {}, info)
    if not refused:
        assert problem is None
        return
    assert (f"/ckpt/run is on {fstype} (bucket mounted at /ckpt), which renames a folder by copying its files one by "
            "one" in problem and "Save to a local disk or an NFS/Filestore share" in problem), problem
    assert (other_way in problem) if other_way else "; or" not in problem
    said_atomic = mounts.copying_rename_problem("/ckpt/run", {mounts.ATOMIC_RENAMES_ENV: "1"}, info)
    assert said_atomic is None


def test_no_mountinfo_is_no_problem(tmp_path):
    assert mounts.mount_of("/", str(tmp_path / "missing")) is None
    assert mounts.copying_rename_problem("/", {}, str(tmp_path / "missing")) is None


def test_this_machines_mountinfo_is_read():
    """The reader understands the real file: the root folder is on a mount at /."""
    assert mounts.mount_of("/").point == "/"
