"""What a process writes into its environment for itself alone: its device topology, its rank of a one-process world.

PJRT reads a process's topology from the environment (``CPU_NUM_DEVICES``, ``TPU_VISIBLE_CHIPS``, ...) and DeepSpeed
its rank, so a process sets them in ``os.environ`` before its runtime starts. Every process it then starts inherits
them (``multiprocessing`` with fork, spawn or forkserver, ``torch.multiprocessing.spawn``, ``subprocess``, DeepSpeed's
own test harness): a child would count one device, or take its parent's chip. Changes made inside ``for_this_process``
are recorded in ``bootstrap.PROCESS_ENV``, and a child undoes them before anything reads them: at interpreter start (the
startup hook) or right after a fork (here).
"""
import contextlib
import json
import os
from typing import Dict, Iterator, Mapping, Optional, Tuple

from deepspeed_xla.bootstrap import PROCESS_ENV, restore_inherited_env, undo_changes

#: name -> (value before this process's first change, value it holds now); None: unset.
_changes: Dict[str, Tuple[Optional[str], Optional[str]]] = {}


@contextlib.contextmanager
def for_this_process() -> Iterator[None]:
    """Whatever the block sets in or removes from ``os.environ`` stays in this process, not in the ones it starts."""
    before = dict(os.environ)
    try:
        yield
    finally:
        _record(before)


def _record(before: Dict[str, str]) -> None:
    for name in (set(before) | set(os.environ)) - {PROCESS_ENV}:
        old, new = before.get(name), os.environ.get(name)
        if old == new:
            continue
        first = _changes.get(name, (old, None))[0]
        if first == new:
            _changes.pop(name, None)
        else:
            _changes[name] = (first, new)
    if _changes:
        os.environ[PROCESS_ENV] = json.dumps({"pid": os.getpid(), "vars": _changes}, sort_keys=True)
    else:
        os.environ.pop(PROCESS_ENV, None)


def launch_environment() -> Mapping[str, str]:
    """The environment as this process's children see it: its own changes undone (how many devices the host has,
    asked after this process took one of them)."""
    if not _changes:
        return os.environ
    env = dict(os.environ)
    undo_changes(env, _changes.items())
    env.pop(PROCESS_ENV, None)
    return env


def _forget_in_child() -> None:
    _changes.clear()
    restore_inherited_env()


os.register_at_fork(after_in_child=_forget_in_child)
