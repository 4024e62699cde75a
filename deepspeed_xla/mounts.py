"""Which mount a path lives on, and whether that filesystem renames a folder in one step.

A checkpoint becomes visible by renaming its folder (``checkpoint_tags.promote``). Object-store filesystems in
user space (gcsfuse on a bucket without hierarchical namespace, s3fs, rclone, blobfuse) rename a folder by copying
and deleting its files one by one: a job stopped during the rename leaves a tag holding part of a checkpoint, or
part of two. What they are is read from ``/proc/self/mountinfo`` (``proc(5)``), not guessed from the path.
"""
import os
import re
from typing import NamedTuple, Optional

MOUNTINFO = "/proc/self/mountinfo"
#: Set to 1 where a folder rename is one step on a filesystem listed below (a gcsfuse bucket with hierarchical
#: namespace): ``DS_XLA_*`` reaches every host through the runner.
ATOMIC_RENAMES_ENV = "DS_XLA_ATOMIC_RENAMES"
#: Filesystem types (mountinfo's field after ``-``) that rename a folder file by file, each with what renames one in
#: one step where there is such a thing.
COPYING_RENAMES = {
    "fuse.gcsfuse": f"a bucket with hierarchical namespace renames folders in one step: on one, set "
                    f"{ATOMIC_RENAMES_ENV}=1",
    "fuse.blobfuse2": f"an account with hierarchical namespace (ADLS Gen2) renames folders in one step: on one, set "
                      f"{ATOMIC_RENAMES_ENV}=1",
    "fuse.s3fs": "",
    "fuse.goofys": "",
    "fuse.rclone": "",
}


class Mount(NamedTuple):
    point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline and backslash in a path as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def mount_of(path: str, mountinfo: Optional[str] = None) -> Optional[Mount]:
    """The mount that holds ``path`` (or, not made yet, the folder it will be made in); None where the system has
    no mountinfo (not Linux)."""
    try:
        with open(mountinfo or MOUNTINFO, encoding="utf-8", errors="surrogateescape") as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    folder = os.path.realpath(path)
    best = None
    for line in lines:
        fields, _, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        point = _unescape(fields[4])
        inside = folder == point or folder.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):  # a later mount over the same point wins
            best = Mount(point, tail[0], _unescape(tail[1]))
    return best


def copying_rename_problem(path: str, environ=os.environ, mountinfo: Optional[str] = None) -> Optional[str]:
    """Why folders under ``path`` cannot be renamed in one step, with the fix; None where they can (or the user
    says so with ``DS_XLA_ATOMIC_RENAMES=1``)."""
    mount = mount_of(path, mountinfo)
    if mount is None or mount.fstype not in COPYING_RENAMES or environ.get(ATOMIC_RENAMES_ENV, "").strip() == "1":
        return None
    other_way = COPYING_RENAMES[mount.fstype]
    return (f"{path} is on {mount.fstype} ({mount.source} mounted at {mount.point}), which renames a folder by "
            "copying its files one by one: a job stopped while a checkpoint takes its tag's name would leave a tag "
            "holding part of a checkpoint. Save to a local disk or an NFS/Filestore share and copy complete "
            f"checkpoints to the bucket{'; or ' + other_way if other_way else ''}.")
