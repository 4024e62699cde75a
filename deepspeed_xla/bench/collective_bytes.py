"""The collectives of a multi-process system per step, counted where its ranks call their process groups.

On PJRT CPU the ``xla_host`` backend runs collectives between graphs, so the step graph's HLO holds none
(``bench.cost`` counts 0); ``comm.accounting`` counts them at the process groups' entry points instead, the same calls
``xla_ds`` gets on a TPU. The bench turns it on for a system (``count_in``); ``scripts/train.py`` marks the totals at
the end of its warm-up and of training, and ``per_step`` divides their difference by the steps between.
"""
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from deepspeed_xla.bench.roofline import wire_bytes
from deepspeed_xla.comm.accounting import ENV


def count_in(env: dict, prefix: Path) -> None:
    """Have the ranks started with ``env`` count their collectives into ``<prefix>.rank<r>.jsonl`` (old files go)."""
    for old in prefix.parent.glob(f"{prefix.name}.rank*.jsonl"):
        old.unlink()
    env[ENV] = str(prefix)


def read_marks(prefix: Path, procs: int) -> List[List[List[dict]]]:
    """Each rank's marks in order, each the totals ``comm.accounting.mark`` wrote."""
    import json
    return [[json.loads(line)["totals"] for line in Path(f"{prefix}.rank{rank}.jsonl").read_text().splitlines()]
            for rank in range(procs)]


def _key(entry: dict) -> Tuple[str, Tuple[int, ...]]:
    return entry["kind"], tuple(entry["ranks"])


def per_step(before: Sequence[dict], after: Sequence[dict], steps: int) -> List[dict]:
    """What was counted between two marks ``steps`` steps apart, per step: each kind and group that moved anything,
    as ``{"kind", "ranks", "group_size", "calls_per_step", "bytes_per_step"}``."""
    start: Dict[Tuple[str, Tuple[int, ...]], dict] = {_key(e): e for e in before}
    result = []
    for entry in after:
        old = start.get(_key(entry), {"calls": 0, "bytes": 0})
        calls = entry["calls"] - old["calls"]
        if calls:
            result.append({"kind": entry["kind"], "ranks": entry["ranks"], "group_size": len(entry["ranks"]),
                           "calls_per_step": calls / steps, "bytes_per_step": (entry["bytes"] - old["bytes"]) / steps})
    return result


def summary(prefix: Path, procs: int, steps: int) -> dict:
    """The ``collectives_counted`` object of a bench row: every rank's collectives per step between its first and
    last mark (``steps`` apart), the busiest rank's by kind and group (``collectives``: a step waits for it), their
    total bytes, and the bytes one device sends for them by a ring (``roofline.wire_bytes``)."""
    try:
        marks = read_marks(prefix, procs)
    except FileNotFoundError as error:
        return {"error": f"{error}: the ranks marked no collectives (scripts/train.py marks them after its warm-up)"}
    by_rank = [per_step(rank_marks[0], rank_marks[-1], steps) for rank_marks in marks]
    busiest: Dict[Tuple[str, Tuple[int, ...]], dict] = {}
    for entries in by_rank:
        for entry in entries:
            key = _key(entry)
            if key not in busiest or entry["bytes_per_step"] > busiest[key]["bytes_per_step"]:
                busiest[key] = entry
    collectives = [busiest[key] for key in sorted(busiest)]
    wire = sum(wire_bytes({"kind": c["kind"], "bytes": c["bytes_per_step"], "replica_groups": [c["ranks"]]}, procs)
               for c in collectives if c["kind"] != "send")
    return {"collectives": collectives, "bytes_per_step": sum(c["bytes_per_step"] for c in collectives),
            "wire_bytes_per_step": wire, "by_rank": by_rank}


def table(rows: Sequence[dict]) -> List[str]:
    """Text lines of the counted collectives of the rows that have them: system, kind, group size, calls and MB per
    step."""
    lines = []
    for row in rows:
        counted = (row.get("cost") or {}).get("collectives_counted") or {}
        for c in counted.get("collectives", []):
            lines.append(f"{row['system']:<24} {c['kind']:<15} {c['group_size']:>5} {c['calls_per_step']:>10.2f} "
                         f"{c['bytes_per_step'] / 1e6:>12.4f}")
    if not lines:
        return []
    return ["", "collectives per step, counted at the ranks' process groups (what xla_ds gets on a TPU):",
            f"{'system':<24} {'kind':<15} {'group':>5} {'calls/step':>10} {'MB/step':>12}", *lines]
