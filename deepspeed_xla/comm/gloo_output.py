"""gloo's connection lines: held back while a group connects; whole, and by rank, with ``DS_XLA_VERBOSE=1``.

gloo's TCP transport writes ``[Gloo] Rank r is connected to n peer ranks. Expected number of connected peer ranks
is : n`` to ``std::cout`` each time a group connects (``tcp::Context::createAndConnectAllPairs`` calls
``printConnectivityInfo``, lazy groups too); no log level governs it. The deepspeed launcher starts its workers with
``python -u``, which leaves C's stdout unbuffered, so each ``<<`` is a write of its own and two ranks' lines
interleave mid-line: the first thing a new user read was ``[Gloo] Rank [Gloo] Rank 1 is connected to 01 is ...``.

While a group connects, this process's file descriptor 1 goes to a temporary file. What gloo wrote there is dropped,
or with ``DS_XLA_VERBOSE=1`` written back with the rank in front, one whole line per write (a pipe never splits a
write under 4 KiB); anything else written meanwhile (another thread's) is written back as it was.
"""
import contextlib
import ctypes
import os
import sys
import tempfile
from typing import Iterator

from deepspeed_xla import env_vars, launch_env

VERBOSE_ENV = "DS_XLA_VERBOSE"
GLOO_LINE = "[Gloo] "


def verbose() -> bool:
    """``DS_XLA_VERBOSE=1``: the libraries' own lines that deepspeed_xla holds back are shown (whole, by rank)."""
    return bool(env_vars.flag(os.environ, VERBOSE_ENV))


def _flush() -> None:
    """Python's and C's buffered stdout out to the descriptor they belong to, before it moves."""
    if sys.stdout is not None:
        sys.stdout.flush()
    ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def held_back(group_rank: int) -> Iterator[None]:
    """Around gloo's connection of one group (``group_rank``: this process's rank in it, when no launcher says)."""
    show = verbose()  # a bad value fails before the group connects
    _flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout (closed by a daemon): gloo's writes go nowhere anyway
        yield
        return
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 1)
            try:
                yield
            finally:
                _flush()
                os.dup2(saved, 1)
                held.seek(0)
                _write_back(held.read().decode(errors="replace"), group_rank, show)
    finally:
        os.close(saved)


def _write_back(text: str, group_rank: int, show: bool) -> None:
    position = launch_env.global_rank_and_size()
    prefix = f"[rank {position[0] if position else group_rank}] "
    for line in text.splitlines(keepends=True):
        if not line.startswith(GLOO_LINE):
            os.write(1, line.encode())
        elif show:
            os.write(1, (prefix + line.rstrip("\n") + "\n").encode())
