"""Every rank of a job must train with the same DeepSpeed config, the same package versions and the same job-wide
settings from the environment.

A rank launched with another config file (a stale copy on one host) or from another environment (one host's venv
upgraded) otherwise starts training: ZeRO partitions and buckets of other sizes, graphs that differ between ranks,
collectives that hang or mix unrelated values, far from the cause. ``deepspeed.initialize`` compares them once, on
every rank (``patches/engine.py``, ``ranks_agree``): one object collective of a digest, none per step.
"""
import hashlib
import json
import os
import re
from importlib import metadata
from typing import Callable, Dict, List

from deepspeed_xla.comm.preemption import SAVE_DIR_ENV

DISTRIBUTIONS = ("torch", "torch_xla", "deepspeed", "deepspeed_xla")
#: A config value under a key with one of these words (``output_path``, ``nvme_path``, ``output_file``) is where a
#: rank (or host) writes or reads its own files: it may legitimately differ between ranks. Whole words, so that
#: ``flops_profiler``'s settings still count.
PER_RANK_KEY_PARTS = ("path", "dir", "file", "folder", "filename", "dirname")
_JSON_LEAVES = (str, int, float, bool, type(None))
#: Environment variables that switch on a job-wide behaviour with collectives of its own: whether each is set must be
#: the same on every rank (its value may be a per-host path). ``DS_XLA_CHECKPOINT_ON_SIGTERM`` on some hosts only
#: would leave the ranks that save waiting for the others in the save's collectives.
SWITCHES = (SAVE_DIR_ENV, )


def versions() -> Dict[str, str]:
    """The installed release of each distribution a rank's training depends on (read now, not at import)."""
    found = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _per_rank(key: str) -> bool:
    return any(word in PER_RANK_KEY_PARTS for word in re.split(r"[^a-z0-9]+", key.lower()))


def config_values(config, prefix: str = "") -> Dict[str, object]:
    """The config's settings as ``{"zero_optimization.stage": 2, ...}``: values every rank must share.

    Left out: per-rank file locations (``PER_RANK_KEY_PARTS``) and values that are not JSON (process groups or
    modules that frameworks put into the dict: each rank holds its own objects).
    """
    if isinstance(config, dict):
        flat = {}
        for key, value in config.items():
            if not _per_rank(str(key)):
                flat.update(config_values(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(config, (list, tuple)):
        items = [config_values(item) for item in config]
        if all(set(item) == {""} for item in items):
            return {prefix: [item[""] for item in items]}
        return {k: v for i, item in enumerate(items) for k, v in config_values(item, f"{prefix}[{i}]").items()}
    return {prefix: config} if isinstance(config, _JSON_LEAVES) else {}


def switches(environ=os.environ) -> Dict[str, str]:
    """Whether each of ``SWITCHES`` is set (to something other than blanks) in this rank's environment."""
    return {name: "set" if environ.get(name, "").strip() else "not set" for name in SWITCHES}


def rank_state(config: dict) -> dict:
    """What this rank must share with every other: its config values, package versions and switches."""
    return {"config": config_values(config), "versions": versions(), "environment": switches()}


def _digest(state: dict) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=repr).encode()).hexdigest()


def _ranks(ranks: List[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _describe(what: str, by_rank: List[object]) -> str:
    """``what``'s values and which ranks hold each; the most common value (rank 0's on a tie) first."""
    holders: Dict[str, List[int]] = {}
    for rank, value in enumerate(by_rank):
        holders.setdefault(json.dumps(value, sort_keys=True, default=repr), []).append(rank)
    values = sorted(holders.items(), key=lambda item: (-len(item[1]), item[1][0]))
    common, odd = values[0], values[1:]
    return (f"{what}: " + "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in odd) +
            f" (the others: {common[0]} on {_ranks(common[1])})")


_MISSING = "<not set>"


def disagreements(states: List[dict]) -> List[str]:
    """Each setting or version on which the ranks' ``rank_state`` differ, naming the odd ranks and every value."""
    found = []
    for section, label in (("versions", "version of"), ("config", "config"), ("environment", "environment variable")):
        keys = sorted({key for state in states for key in state[section]})
        for key in keys:
            by_rank = [state[section].get(key, _MISSING) for state in states]
            if any(value != by_rank[0] for value in by_rank):
                found.append(_describe(f"{label} {key!r}" if section == "config" else f"{label} {key}", by_rank))
    return found


def check(config: dict, all_gather_object: Callable[[list, object], None], world_size: int) -> None:
    """Raise on every rank, with the same message, if the ranks' configs or versions differ.

    ``all_gather_object(object_list, obj)``: over every rank of the job. The digests are gathered first; the
    states themselves only when they differ (every rank sees that, so every rank gathers them).
    """
    if world_size == 1:
        return
    state = rank_state(config)
    digests: List[object] = [None] * world_size
    all_gather_object(digests, _digest(state))
    if len(set(digests)) == 1:
        return
    states: List[object] = [None] * world_size
    all_gather_object(states, state)
    odd_switches = [name for name in SWITCHES if len({state["environment"][name] for state in states}) > 1]
    raise RuntimeError(
        "deepspeed_xla: the ranks of this job were launched differently: " + " | ".join(disagreements(states)) +
        ". Every rank must run the same DeepSpeed config and the same torch, torch_xla, deepspeed and deepspeed_xla: "
        "give every host the same config file and environment (docs/bad_input.md)" +
        "".join(f"; set {name} on every host (in .deepspeed_env, which the runner hands every host) or on none"
                for name in odd_switches) + ".")
