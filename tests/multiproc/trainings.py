"""The ``scripts/train.py`` trainings a session's tests share (the ``trainings`` fixture): planned in groups, each
distinct training run once, several to a launched job."""
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from tests.conftest import FAST_COMPILE
from tests.multiproc.launching import (TRAIN, TRAIN_MANY, WARMUP_STEPS, launch_command, read_results, run_forked_job,
                                       run_job, train_arguments)


def training(accelerator: Optional[str], config: dict, num_procs: int = 1, steps: int = 20,
             train_args: Sequence[str] = (), extra_env: Optional[dict] = None, save_at: Sequence[int] = (),
             dump_hlo: bool = False, launcher: Optional[str] = None, load_from: Optional[dict] = None) -> dict:
    """One training of ``Trainings``, as data. ``save_at``: steps after which it saves a checkpoint into its
    ``result["save_dir"]``; ``dump_hlo``: XLA writes the HLO of every graph it compiles into ``result["hlo_dir"]``;
    ``load_from``: another training whose checkpoints it resumes from. One process runs as ``python
    scripts/train.py`` unless ``launcher`` asks for ``deepspeed``: the launcher is under test in the multi-process
    runs, and skipping its two interpreters halves a one-process run. DeepSpeed's CPU accelerator, the reference,
    tests no launcher: its ranks fork from a fork server (``"fork"``), which spares a job its runner, launcher and
    the ranks' imports (docs/performance.md)."""
    default = "fork" if accelerator == "cpu" else "python" if num_procs == 1 else "deepspeed"
    return {"accelerator": accelerator, "config": config, "num_procs": num_procs, "steps": steps,
            "train_args": list(train_args), "extra_env": {k: str(v) for k, v in (extra_env or {}).items()},
            "save_at": list(save_at), "dump_hlo": dump_hlo, "launcher": launcher or default, "load_from": load_from}


def _key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True, default=str)


# What a job's processes share: trainings differing only in this run in one job.
_JOB = ("accelerator", "num_procs", "extra_env", "dump_hlo", "launcher")
_PLANNED: Dict[str, List[dict]] = {}


def plan(group: str, *trainings: dict) -> None:
    """Declare trainings (``training(...)``) that tests of this session will ask ``Trainings`` for. When a test
    first asks for one, those of its group that need the same processes run in one job (``tests/train_many.py``),
    in the order planned: one launch, one set of interpreters, for all of them. Call at import (collection)."""
    for spec in trainings:
        assert not spec["dump_hlo"] or spec["num_procs"] == 1, "the HLO of a job's runs is told apart on one rank"
        _PLANNED.setdefault(group, []).append(spec)


def plan_against_cpu(group: str, config: dict, **kwargs) -> None:
    """``plan`` the XLA and the CPU-accelerator side of ``Trainings.against_cpu(config, **kwargs)``."""
    plan(group, training("xla", config, **kwargs), training("cpu", config, **kwargs))


class Trainings:
    """The trainings shared by the tests of a session (the ``trainings`` fixture): each distinct training runs
    once, the first time a test asks for it (with the rest of its ``plan`` group), and later tests get the same
    result. Results are shared: tests must not modify them."""

    def __init__(self, root: Path):
        self.root = root
        self._runs: Dict[str, Future] = {}
        self._workdirs: Dict[str, Path] = {}
        self._threads: List[threading.Thread] = []
        self._lock = threading.Lock()

    def run(self, accelerator: Optional[str], config: dict, **kwargs) -> dict:
        """The result of ``training(accelerator, config, **kwargs)``: ``run_training``'s, with ``save_dir`` and
        ``hlo_dir``."""
        return self.result(training(accelerator, config, **kwargs))

    def result(self, spec: dict) -> dict:
        key = _key(spec)
        with self._lock:
            jobs = [] if key in self._runs else self._jobs_of(spec)
            for member in (member for job in jobs for member in job):
                self._runs[_key(member)] = Future()
                self._workdirs[_key(member)] = self.root / f"run{len(self._workdirs)}"
        for job in jobs[1:]:  # the group's other jobs (the CPU side of an XLA job) run meanwhile
            thread = threading.Thread(target=self._launch, args=(job, ), daemon=True)
            thread.start()
            self._threads.append(thread)
        if jobs:
            self._launch(jobs[0])
        return self._runs[key].result()

    def close(self) -> None:
        """Wait for the jobs started for other tests (a session that asked for only part of a group)."""
        for thread in self._threads:
            thread.join()

    def _jobs_of(self, spec: dict) -> List[List[dict]]:
        """The jobs that start when ``spec`` is first asked for: its own first (``spec`` and the trainings planned
        with it that need the same processes), then the other jobs of its group; only trainings not yet started."""
        key = _key(spec)
        group = next((group for group in _PLANNED.values() if any(_key(p) == key for p in group)), [spec])
        jobs: Dict[str, Dict[str, dict]] = {}
        for planned in group:
            if _key(planned) not in self._runs:
                jobs.setdefault(_key({f: planned[f] for f in _JOB}), {})[_key(planned)] = planned
        own = _key({f: spec[f] for f in _JOB})
        return [list(jobs.pop(own).values()), *(list(job.values()) for job in jobs.values())]

    def _launch(self, job: List[dict]) -> None:
        """Run ``job``'s trainings in one launched job; each one's future gets its result (or the job's error)."""
        try:
            first, runs, results = job[0], [], []
            for spec in job:
                workdir = self._workdirs[_key(spec)]
                args = list(spec["train_args"])
                if spec["save_at"]:
                    args += ["--save-dir", str(workdir / "checkpoints"), "--save-at", *map(str, spec["save_at"])]
                if spec["load_from"]:
                    args += ["--load-dir", str(self.result(spec["load_from"])["save_dir"])]
                args, out = train_arguments(workdir, spec["accelerator"] or "default", spec["config"], spec["steps"],
                                            args)
                hlo_dir = workdir / "hlo" if spec["dump_hlo"] else None
                runs.append({"args": args, "hlo_dir": hlo_dir and str(hlo_dir)})
                results.append((spec, out, {"save_dir": workdir / "checkpoints" if spec["save_at"] else None,
                                            "hlo_dir": hlo_dir}))
            extra_env, jobdir = dict(first["extra_env"]), self._workdirs[_key(first)]
            dumps = jobdir / ("hlo" if len(runs) == 1 else "job-hlo")
            if first["dump_hlo"]:
                flags = extra_env.get("XLA_FLAGS", FAST_COMPILE["XLA_FLAGS"])
                extra_env["XLA_FLAGS"] = f"{flags} --xla_dump_to={dumps} --xla_dump_hlo_as_text"
            plan_file, timeout = jobdir / "runs.json", 600 + 120 * len(runs)
            if first["launcher"] == "fork":
                plan_file.write_text(json.dumps(runs))
                run_forked_job("tests.train_many:main", first["accelerator"], first["num_procs"], extra_env, timeout,
                               args=["--runs", plan_file])
            else:
                if len(runs) == 1:
                    script = [TRAIN, *runs[0]["args"]]
                else:
                    plan_file.write_text(json.dumps(runs))
                    script = [TRAIN_MANY, "--runs", plan_file, *(("--hlo-dumps", dumps) if first["dump_hlo"] else ())]
                cmd, env = launch_command(script, first["accelerator"], first["num_procs"], extra_env,
                                          first["launcher"])
                run_job(cmd, env, jobdir, timeout)
            for spec, out, dirs in results:
                self._runs[_key(spec)].set_result({**read_results(out, spec["num_procs"]), **dirs})
        except BaseException as exc:  # every test waiting on this job fails with the same error
            for spec in job:
                if not self._runs[_key(spec)].done():
                    self._runs[_key(spec)].set_exception(exc)

    def against_cpu(self, config: dict, **kwargs) -> Tuple[dict, dict]:
        """The same training on XLA and on DeepSpeed's CPU accelerator, run concurrently; ``(xla, cpu)``. ``kwargs``
        go to ``training`` for both (``dump_hlo`` to the XLA side only)."""
        dump_hlo = kwargs.pop("dump_hlo", False)
        with ThreadPoolExecutor(max_workers=2) as pool:
            xla = pool.submit(self.run, "xla", config, dump_hlo=dump_hlo, **kwargs)
            cpu = pool.submit(self.run, "cpu", config, **kwargs)
            return xla.result(), cpu.result()


def counts_per_step(result: dict) -> dict:
    """After ``scripts/train.py``'s warm-up: XLA compilations (in all), executions and device->host transfers per step."""
    warm, end = result["counters"]["warm"], result["counters"]["end"]
    steps = len(result["losses"]) - WARMUP_STEPS
    return {key: (end[key] - warm[key]) / (1 if key == "compilations" else steps) for key in end}
