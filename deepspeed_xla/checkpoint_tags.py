"""A checkpoint's folders and ``latest``: a tag appears whole or not at all, ``latest`` names only complete tags, and
nothing is written through a link that someone else left in ``save_dir``.

DeepSpeed's rank 0 writes ``latest`` right after its own files, while other ranks may still be writing theirs, and
rewrites it in place: a rank killed during a save can leave ``latest`` naming an incomplete checkpoint, or empty. Here
``latest`` is replaced atomically once every rank's files are written and flushed. A tag is written aside
(``<tag>.saving``) and takes the tag's name only when it is complete, so saving a tag again (a "last" or "best"
checkpoint) never leaves it half old, half new.
"""
import contextlib
import ctypes
import errno
import os
import shutil
import stat
import warnings
from typing import Optional

from deepspeed_xla import mounts

LATEST = "latest"
SAVING_SUFFIX = ".saving"
REPLACED_SUFFIX = ".replaced"  # an old tag moved aside where folders cannot be swapped
WRITER_MARK = ".deepspeed_xla_writer."  # in <tag>.saving while its ranks write: whose save_dir each rank sees
#: A file this package creates: a new one, never one a symbolic link leads to.
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def fsync(path: str) -> None:
    """Flush a file, or a folder's entries, to disk."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else os.O_RDONLY
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_save_dir(save_dir: str) -> None:
    """Refuse a ``save_dir`` (or, not made yet, the folder it will be made in) that every user may write to and that
    lacks the sticky bit: anyone could leave a symbolic link there for a save to write through, or swap a tag. Refuse
    one on a filesystem that renames folders file by file (``mounts``): a tag could hold part of a checkpoint."""
    folder = os.path.abspath(save_dir)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    mode = os.stat(folder).st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise PermissionError(
            errno.EPERM, f"deepspeed_xla: every user may write to the checkpoint folder {folder} (mode "
                         f"{stat.S_IMODE(mode):o}, no sticky bit): another user could leave a symbolic link there that "
                         f"a save would write through, or replace a checkpoint. Run `chmod o-w {folder}` (or "
                         f"`chmod +t {folder}`), or save to a folder only you can write.")
    problem = mounts.copying_rename_problem(folder)
    if problem:
        raise OSError(errno.EOPNOTSUPP, f"deepspeed_xla: the checkpoint folder {problem}")


def _write_new(path: str, text: str) -> None:
    """Write ``text`` to a file made new at ``path`` and flush it to disk; one left there by a crashed save of the
    same process id is replaced."""
    try:
        fd = os.open(path, _NEW_FILE, 0o666)
    except FileExistsError:
        os.unlink(path)  # a link is removed, not followed
        fd = os.open(path, _NEW_FILE, 0o666)
    with open(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``save_dir/latest`` at ``tag`` atomically: readers see the old tag or the new one, never a part.
    The tag's folder entries reach the disk first; a failed write leaves the old ``latest`` and no temporary file."""
    tag_dir = os.path.join(save_dir, str(tag))
    if os.path.isdir(tag_dir):
        fsync(tag_dir)
    path = os.path.join(save_dir, LATEST)
    staging = f"{path}.tmp.{os.getpid()}"
    try:
        _write_new(staging, tag)
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise
    fsync(save_dir)


def saving_tag(tag: str) -> str:
    """The folder a checkpoint under ``tag`` is written into until every rank's files are complete."""
    return f"{tag}{SAVING_SUFFIX}"


def discard_unfinished(save_dir: str, tag: str) -> None:
    """Remove what an interrupted save under ``tag`` left, before the tag is written again; a symbolic link there is
    removed, not followed (the save then writes into a folder of its own)."""
    unfinished = os.path.join(save_dir, saving_tag(tag))
    if os.path.islink(unfinished):
        os.unlink(unfinished)
    shutil.rmtree(unfinished, ignore_errors=True)


def mark_writer(save_dir: str, tag: str, rank: int) -> None:
    """Make ``saving_tag(tag)`` with a mark of ``rank`` in it. The ranks that make ``save_dir`` (rank 0, or each host's
    local rank 0 with node-local storage) mark it once every such rank has removed what an earlier save left, and
    every rank counts the marks it sees (``writers_seen``) once every writer has marked: one where the folder is what
    the setting says, none where ``save_dir`` is each host's own disk, several where node-local storage is one folder
    every host shares."""
    folder = os.path.join(save_dir, saving_tag(tag))
    os.makedirs(folder, exist_ok=True)
    _write_new(os.path.join(folder, f"{WRITER_MARK}{rank}"), "")


def writers_seen(save_dir: str, tag: str) -> int:
    """How many writers' marks (``mark_writer``) this rank sees."""
    try:
        return sum(name.startswith(WRITER_MARK) for name in os.listdir(os.path.join(save_dir, saving_tag(tag))))
    except FileNotFoundError:
        return 0


def unmark_writer(save_dir: str, tag: str, rank: int) -> None:
    """Remove ``rank``'s mark before the tag is given its name: a checkpoint holds DeepSpeed's files only."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(save_dir, saving_tag(tag), f"{WRITER_MARK}{rank}"))


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
    is moved aside first, and for that moment the tag is missing: a load then reads the old one from
    ``<tag>.replaced`` (``loadable_tag``), which the next save of the tag removes.
    """
    final, incoming = os.path.join(save_dir, tag), os.path.join(save_dir, saving_tag(tag))
    aside = f"{final}{REPLACED_SUFFIX}"
    if os.path.islink(incoming):
        raise OSError(errno.ELOOP, f"{incoming} became a symbolic link during the save: not given the name {tag}")
    fsync(incoming)
    if not os.path.exists(final):
        os.rename(incoming, final)
        incoming = aside  # the old contents of a save that stopped between its two renames, if any
    elif not _exchange(incoming, final):
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        os.rename(incoming, final)
        incoming = aside
    shutil.rmtree(incoming, ignore_errors=True)  # the old contents
    fsync(os.path.dirname(final))


def latest_tag(load_dir: str, universal: bool = False) -> Optional[str]:
    """The tag ``latest`` (``latest_universal``) names, read as DeepSpeed reads it; None without one."""
    path = os.path.join(load_dir, "latest_universal" if universal else LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as file:
        return file.read().strip()


def loadable_tag(load_dir: str, tag: str, warn: bool = True) -> str:
    """``tag``, or ``<tag>.replaced`` where ``tag`` is missing because a save that moved it aside stopped before it
    gave the new checkpoint the name: that folder holds the complete checkpoint ``latest`` named."""
    folder = os.path.join(load_dir, str(tag))
    aside = f"{folder}{REPLACED_SUFFIX}"
    if os.path.isdir(folder) or not os.path.isdir(aside):
        return tag
    if warn:
        warnings.warn(f"deepspeed_xla: the checkpoint {folder} is missing, and {aside} holds the one it replaced (a "
                      "save stopped between moving the old one aside and naming the new one): loading that. Saving "
                      f"under {tag!r} again removes it.", RuntimeWarning, stacklevel=2)
    return f"{tag}{REPLACED_SUFFIX}"


def other_checkpoints(tag_dir: str) -> str:
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
