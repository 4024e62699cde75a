"""The collectives of a multi-process system per step, counted where its ranks call their process groups.

On PJRT CPU the ``xla_host`` backend runs collectives between graphs, so the step graph's HLO holds none
(``bench.cost`` counts 0); ``comm.accounting`` counts them at the process groups' entry points instead, the same calls
``xla_ds`` gets on a TPU. The bench turns it on for a system (``count_in``); ``scripts/train.py`` marks the totals at
the end of its warm-up and of training, and ``per_step`` divides their difference by the steps between.
"""
import argparse
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from deepspeed_xla.bench.roofline import TPUS, wire_bytes
from deepspeed_xla.comm.accounting import ENV


def count_in(env: dict, prefix: Path) -> None:
    """Have the ranks started with ``env`` count their collectives into ``<prefix>.rank<r>.jsonl`` (old files go)."""
    for old in prefix.parent.glob(f"{prefix.name}.rank*.jsonl"):
        old.unlink()
    env[ENV] = str(prefix)


def counting(env: dict, system, args: argparse.Namespace, workdir: Path) -> Optional[Path]:
    """With ``--cost``, a DeepSpeed system of several XLA processes through ``scripts/train.py`` counts its
    collectives (``count_in``); returns where, or None."""
    if not (args.cost and system.accelerator == "xla" and system.procs > 1 and not system.trainer):
        return None
    prefix = workdir / f"{system.name}.collectives"
    count_in(env, prefix)
    return prefix


def attach(row: dict, prefix: Optional[Path], system, args: argparse.Namespace) -> None:
    """The ``collectives_counted`` object (``summary``) into the row's ``cost``, for a system that ``counting`` set
    counting, with the roofline's collective term on ``args.tpu``: the bytes sent per device over its ICI bandwidth
    (an estimate, ``collective_s``)."""
    if prefix is not None and "cost" in row:
        counted = summary(prefix, system.procs, args.steps - args.warmup)
        if "error" not in counted:
            counted.update(tpu=args.tpu, collective_s=counted["wire_bytes_per_step"] / TPUS[args.tpu].ici_bytes_per_s)
        row["cost"]["collectives_counted"] = counted


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
    last mark (``steps`` apart); the busiest rank's by kind and group (``collectives``: a step waits for it), each with
    the bytes one device sends for it by a ring (``roofline.wire_bytes``; a send: all of it); their totals."""
    try:
        marks = read_marks(prefix, procs)
    except FileNotFoundError as error:
        return {"error": f"{error}: the ranks marked no collectives (scripts/train.py marks them after its warm-up)"}
    by_rank = [per_step(rank_marks[0], rank_marks[-1], steps) for rank_marks in marks]
    busiest: Dict[Tuple[str, Tuple[int, ...]], dict] = {}
    for entry in (entry for entries in by_rank for entry in entries):
        if _key(entry) not in busiest or entry["bytes_per_step"] > busiest[_key(entry)]["bytes_per_step"]:
            busiest[_key(entry)] = entry
    collectives = []
    for key in sorted(busiest):
        entry = busiest[key]
        wire = entry["bytes_per_step"] if entry["kind"] == "send" else wire_bytes(
            {"kind": entry["kind"], "bytes": entry["bytes_per_step"], "replica_groups": [entry["ranks"]]}, procs)
        collectives.append(dict(entry, wire_bytes_per_step=wire))
    return {"collectives": collectives, "bytes_per_step": sum(c["bytes_per_step"] for c in collectives),
            "wire_bytes_per_step": sum(c["wire_bytes_per_step"] for c in collectives), "by_rank": by_rank}


def table(rows: Sequence[dict]) -> List[str]:
    """Text lines of the counted collectives of the rows that have them: system, kind, group size, calls, bytes and
    ring bytes sent per device, per step."""
    lines = []
    for row in rows:
        counted = (row.get("cost") or {}).get("collectives_counted") or {}
        for c in counted.get("collectives", []):
            lines.append(f"{row['system']:<24} {c['kind']:<15} {c['group_size']:>5} {c['calls_per_step']:>10.2f} "
                         f"{c['bytes_per_step']:>16,.0f} {c['wire_bytes_per_step']:>16,.0f}")
        if "collective_s" in counted:
            lines.append(f"{row['system']:<24} {'total':<15} {'':>5} {'':>10} {counted['bytes_per_step']:>16,.0f} "
                         f"{counted['wire_bytes_per_step']:>16,.0f}  est. {counted['collective_s'] * 1e6:.3g} us on "
                         f"one {counted['tpu']}'s ICI")
        if "error" in counted:
            lines.append(f"{row['system']:<24} {counted['error']}")
    if not lines:
        return []
    return ["", "collectives per step, counted at the ranks' process groups (the calls xla_ds gets on a TPU); bytes: "
                "the whole tensor; sent: per device by a ring",
            f"{'system':<24} {'kind':<15} {'group':>5} {'calls/step':>10} {'bytes/step':>16} {'sent/step':>16}",
            *lines]
