"""Which collective each rank waits in, and the report when a collective times out while every rank waits.

gloo on its own says only that a wait timed out, on the rank whose clock ran out first; a rank that catches the error
(a test harness, a retry loop) goes on to its next collective, which times out in turn, so the job outlived its timeout
and nobody learned where each rank was. NCCL's watchdog and flight recorder tell GPU users that; here each rank's
watchdog publishes what its job thread waits in (``Watchdog.collective``, set by ``watchdog.in_collective``: the op's
signature and its group's global ranks), and the first rank whose collective times out with every other running rank
waiting stops the job with this report: every rank prints it (``failure.FailureRecord``) and ends.
"""
from typing import Dict, List, NamedTuple, Sequence, Tuple

_ON = " on ranks "


class Wait(NamedTuple):
    """One collective a rank waits in: ``op`` (``agreement.signature``: name, root or reduction, tensors) and the
    global ranks of its group."""
    op: str
    ranks: Tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.op}{_ON}{_ranks(self.ranks)}"

    @classmethod
    def parse(cls, text: str) -> "Wait":
        """The ``Wait`` whose ``str`` is ``text``; a text without ranks (another release's) is an op of no group."""
        op, _, ranks = text.rpartition(_ON)
        if not op:
            return cls(text, ())
        return cls(op, tuple(int(rank) for rank in ranks.split(",") if rank.strip().isdigit()))


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


def report(waits: Dict[int, Wait], timed_out: int, timeout: float, env: str) -> str:
    """The failure of a job whose ranks all wait (``waits``: rank -> its collective) and whose rank ``timed_out``
    waited in its collective for ``timeout`` seconds (``env`` sets it): each collective, the ranks waiting in it and
    the members of its group that never arrived."""
    by_wait: Dict[Wait, List[int]] = {}
    for rank in sorted(waits):
        by_wait.setdefault(waits[rank], []).append(rank)
    parts = []
    for wait, ranks in by_wait.items():
        missing = [member for member in wait.ranks if member not in ranks]
        absent = f"; never arrived: rank {_ranks(missing)} ({'; '.join(_elsewhere(missing, waits))})" if missing else ""
        parts.append(f"[{wait.op}{_ON}{_ranks(wait.ranks) or '?'}: waiting rank {_ranks(ranks)}{absent}]")
    return (f"the ranks wait in different collectives, all alive, and rank {timed_out}'s timed out after {env}="
            f"{timeout:g} s: {' '.join(parts)}. A rank took another path than its peers (an error it caught, a "
            f"condition on its rank or its data) or issued the collectives of two groups in another order; the "
            f"traceback of the rank that never arrived shows where it went.")


def _elsewhere(ranks: Sequence[int], waits: Dict[int, Wait]) -> List[str]:
    """Where each of ``ranks`` is instead."""
    return [f"rank {rank} waits in {waits[rank]}" if rank in waits else f"rank {rank} is not in a collective"
            for rank in ranks]
