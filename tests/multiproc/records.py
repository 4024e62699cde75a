"""Modules that train their cases in turn on each rank (``record_cases``), run on both accelerators, each rank's
results read back as a JSON record."""
import json
import os
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

from tests.multiproc.launching import run_forked_job

T = TypeVar("T")


def record_cases(names: Sequence[str], run: Callable[[str], dict], out_env: str) -> None:
    """A rank's side of ``run_rank_records``: ``run(name)`` for each name in turn (a failure records its traceback)
    and this rank's accelerator, written as its JSON record."""
    import deepspeed
    results = {}
    for name in names:
        try:
            results[name] = run(name)
        except Exception:
            results[name] = {"failed": traceback.format_exc()}
    results["accelerator"] = deepspeed.get_accelerator().device_name()
    Path(f"{os.environ[out_env]}.rank{deepspeed.comm.get_rank()}").write_text(json.dumps(results))


def run_rank_records(target: str, accelerator: str, world_size: int, out: Path, out_env: str,
                     extra_env: Optional[dict] = None) -> List[dict]:
    """``run_forked_job(target)`` on ``accelerator`` (``out_env`` names ``out`` to the ranks; ``extra_env``: more
    variables); every rank must write its JSON record to ``<out>.rank<N>``, which are returned in rank order."""
    run_forked_job(target, accelerator, world_size, {**(extra_env or {}), out_env: str(out)}, after_import=(out_env, ))
    return [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(world_size)]


def on_both_accelerators(launch: Callable[[str, Path], T], workdir: Path) -> Tuple[T, T]:
    """``(launch("xla", workdir / "xla"), launch("cpu", workdir / "cpu"))``, the two run concurrently."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [pool.submit(launch, accelerator, workdir / accelerator) for accelerator in ("xla", "cpu")]
        return jobs[0].result(), jobs[1].result()


def records_on_both_accelerators(target: str, world_size: int, workdir: Path, out_env: str,
                                 extra_env: Optional[dict] = None) -> Tuple[list, list]:
    """``(xla, cpu)``: ``run_rank_records(target)`` on each accelerator, the two jobs run concurrently; each a list of
    per-rank records (a module training its cases in turn, ``record_cases``)."""
    return on_both_accelerators(
        lambda accelerator, out: run_rank_records(target, accelerator, world_size, out, out_env, extra_env), workdir)
