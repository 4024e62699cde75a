"""Counting the collectives a process issues, at the entry points of this package's process groups.

Both backends (``xla_host`` on PJRT CPU, ``xla_ds`` on TPU) receive the same ProcessGroup calls from DeepSpeed, so
what is counted here is what a TPU job of the same configuration moves, though ``xla_host`` runs the collectives
between graphs, where the step graph's HLO (``bench.cost``) cannot see them. With ``DS_XLA_COUNT_COLLECTIVES`` set
to a file prefix (the bench's ``--cost`` sets it) each group class gets a counting wrapper on its collectives, and each
``mark`` (``scripts/train.py`` marks where it reads the graph counters: at the end of its warm-up and of training)
appends what was counted so far to ``<name>.rank<r>.jsonl``; unset, nothing is wrapped and nothing is counted. It is
read when a group class is made: ``xla_host``'s when ``host_staged`` is imported, so it must be set before that
(in the environment a launched rank starts with, as the bench does).

A call is counted by its kind, the global ranks of its group and the bytes of the whole tensor it works on: an
all-reduce's, broadcast's or reduce's tensor, an all-gather's or gather's result, a reduce-scatter's, scatter's or
all-to-all's input (what the step graph's accounting counts for an XLA collective); a send by the bytes sent. A call
that another counted call makes (``xla_ds`` handing a group that cannot tile the world to ``xla_host``, a base
method calling its coalesced form) is counted once, by the outer one.
"""
import functools
import json
import os
import threading
from typing import Callable, Dict, List, Sequence, Tuple

ENV = "DS_XLA_COUNT_COLLECTIVES"


def _nbytes(tensors: Sequence["torch.Tensor"]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _flat(lists) -> List["torch.Tensor"]:
    return [t for inner in lists for t in inner]


def _first(args) -> int:
    """The tensor or list of tensors of the call's first argument."""
    return _nbytes(args[0] if isinstance(args[0], (list, tuple)) else [args[0]])


def _second(args) -> int:
    return _nbytes(args[1] if isinstance(args[1], (list, tuple)) else [args[1]])


#: ProcessGroup method -> (kind, bytes of the whole tensor from the call's arguments and the group's size)
METHODS: Dict[str, Tuple[str, Callable[[tuple, int], int]]] = {
    "allreduce": ("all-reduce", lambda a, n: _first(a)),
    "allreduce_coalesced": ("all-reduce", lambda a, n: _first(a)),
    "broadcast": ("broadcast", lambda a, n: _first(a)),
    "reduce": ("reduce", lambda a, n: _first(a)),
    "allgather": ("all-gather", lambda a, n: _nbytes(_flat(a[0]))),
    "allgather_coalesced": ("all-gather", lambda a, n: _nbytes(_flat(a[0]))),
    "_allgather_base": ("all-gather", lambda a, n: _first(a)),
    "allgather_into_tensor_coalesced": ("all-gather", lambda a, n: _first(a)),
    "gather": ("gather", lambda a, n: _second(a) * n),
    "reduce_scatter": ("reduce-scatter", lambda a, n: _nbytes(_flat(a[1]))),
    "_reduce_scatter_base": ("reduce-scatter", lambda a, n: _second(a)),
    "reduce_scatter_tensor_coalesced": ("reduce-scatter", lambda a, n: _second(a)),
    "scatter": ("scatter", lambda a, n: _first(a) * n),
    "alltoall": ("all-to-all", lambda a, n: _second(a)),
    "alltoall_base": ("all-to-all", lambda a, n: _second(a)),
    "send": ("send", lambda a, n: _first(a)),
    "barrier": ("barrier", lambda a, n: 0),
}

#: (kind, the group's global ranks) -> [calls, bytes] since the process started
_TOTALS: Dict[Tuple[str, Tuple[int, ...]], List[int]] = {}
_LOCK = threading.Lock()  # ranks may be threads of one process (tests/comm/xla_threads.py)
_INSIDE = threading.local()  # a counted call in progress on this thread


def enabled() -> bool:
    return bool(os.environ.get(ENV, "").strip())


def _ranks(group) -> Tuple[int, ...]:
    """The group's global ranks (kept on the group); its own ranks when torch does not know it as a group."""
    ranks = group.__dict__.get("_accounting_ranks")
    if ranks is None:
        import torch.distributed as dist
        try:
            ranks = tuple(dist.get_process_group_ranks(group))
        except (KeyError, ValueError, RuntimeError):  # a group built outside torch's registry (tests' threads)
            ranks = tuple(range(group.size()))
        group.__dict__["_accounting_ranks"] = ranks
    return ranks


def _counting(name: str, method: Callable) -> Callable:
    kind, size_of = METHODS[name]

    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        if getattr(_INSIDE, "active", False):
            return method(self, *args, **kwargs)
        nbytes, key = size_of(args, self.size()), (kind, _ranks(self))
        with _LOCK:
            entry = _TOTALS.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += nbytes
        _INSIDE.active = True
        try:
            return method(self, *args, **kwargs)
        finally:
            _INSIDE.active = False

    counted.__wrapped_for_accounting__ = True
    return counted


def instrument(cls: type, force: bool = False) -> type:
    """Wrap ``cls``'s collectives (``METHODS``) to count them, if ``DS_XLA_COUNT_COLLECTIVES`` is set or ``force``;
    returns ``cls``."""
    if not (force or enabled()):
        return cls
    for name in METHODS:
        method = getattr(cls, name, None)
        if method is not None and not getattr(method, "__wrapped_for_accounting__", False):
            setattr(cls, name, _counting(name, method))
    return cls


def totals() -> List[dict]:
    """Every collective counted so far in this process, as ``{"kind", "ranks", "calls", "bytes"}`` sorted by kind and
    group."""
    with _LOCK:
        return [{"kind": kind, "ranks": list(ranks), "calls": calls, "bytes": nbytes}
                for (kind, ranks), (calls, nbytes) in sorted(_TOTALS.items())]


def mark() -> None:
    """With counting on, append ``totals()`` as one JSON line to ``$DS_XLA_COUNT_COLLECTIVES.rank<r>.jsonl`` (``r``:
    this process's global rank); the collectives between two marks are the difference of their totals."""
    if not enabled():
        return
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{os.environ[ENV]}.rank{rank}.jsonl", "a") as out:
        out.write(json.dumps({"rank": rank, "totals": totals()}) + "\n")
