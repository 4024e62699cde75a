"""Multi-process helpers: launching commands in their own session, N ranks of one function (env:// rendezvous),
``scripts/train.py`` through the real ``deepspeed`` CLI with its losses and weights read back (each distinct run
once per session), and the comparison of two such runs."""
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from deepspeed_xla.launch_env import free_port
from tests.conftest import FAST_COMPILE, REPO, VENV_BIN, clean_env


def start_command(cmd, **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` in a new session: the command and everything it starts (the deepspeed runner, its
    launcher, the workers) form one process group, which ``kill_group`` ends."""
    return subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``start_command`` started (what is left of it), then reap its leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the whole group has already exited
    proc.wait()


def run_command(cmd, timeout: float, *, input: Optional[str] = None, **popen_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)``, started by ``start_command``.

    On timeout the whole process group is killed before ``TimeoutExpired`` is raised (``subprocess.run`` kills
    only the command itself, leaving a launcher's workers running); after a normal exit, anything the command
    left behind in its group is killed too.
    """
    proc = start_command(cmd, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_python(code: str, *args: str, cwd=None, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """``python -c code args`` in ``clean_env(**env)``, through ``run_command``."""
    return run_command([sys.executable, "-c", code, *args], timeout, cwd=cwd, env=clean_env(**env))


def last_error(proc: subprocess.CompletedProcess) -> str:
    """The last line of a failed command's stderr: where Python and the deepspeed runner put the error."""
    assert proc.returncode != 0, proc.stdout[-3000:]
    return proc.stderr.strip().splitlines()[-1]


def start_ranks(target: str, world_size: int, env: Optional[dict] = None) -> Tuple[list, list]:
    """Start ``target`` ("module:function", importable from the repo root) once per rank, env:// rendezvous.

    Returns the processes (each in its own session: ``kill_group`` ends it) and their (stdout, stderr) files:
    files, not pipes, since a rank blocked on a full pipe would stall its peers. ``env`` may set ``MASTER_PORT``
    (to find the run's files afterwards).
    """
    module, function = target.split(":")
    code = f"import importlib; importlib.import_module({module!r}).{function}()"
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        rank_env = clean_env(**{"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": rank,
                                "LOCAL_WORLD_SIZE": world_size, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                **(env or {})})
        rank_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), rank_env.get("PYTHONPATH")]))
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        logs.append((out, err))
        procs.append(start_command([sys.executable, "-c", code], cwd=REPO, env=rank_env, stdout=out, stderr=err))
    return procs, logs


def run_ranks(target: str, world_size: int, env: Optional[dict] = None,
              timeout: float = 240) -> List[subprocess.CompletedProcess]:
    """Call ``target`` once per rank (see ``start_ranks``) and wait for all of them.

    On timeout every rank is killed and its stderr says so, so a hang fails the test instead of blocking it.
    """
    deadline = time.monotonic() + timeout
    procs, logs = start_ranks(target, world_size, env)
    results = []
    for rank, (proc, (out, err)) in enumerate(zip(procs, logs)):
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
            note = ""
        except subprocess.TimeoutExpired:
            for other in procs:
                kill_group(other)
            note = f"\n[rank {rank} killed: the ranks did not finish within {timeout:.0f} s]"
        kill_group(proc)
        out.seek(0)
        err.seek(0)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read() + note))
        out.close()
        err.close()
    return results


TRAIN = REPO / "scripts" / "train.py"
WARMUP_STEPS = 3  # scripts/train.py's default --warmup-steps
# The 2-rank runs that tests/launched/test_multiprocess_training.py and test_pipeline.py compare with the CPU
# accelerator, and tests/launched/test_checkpoint.py resumes (``Trainings`` runs each once): 20 steps, saving a
# checkpoint at the end of the warm-up, before the steps whose XLA executions the parity tests count.
TWO_RANK_RUN = {"num_procs": 2, "steps": 20, "save_at": (WARMUP_STEPS, )}


def ds_config(stage: int, bf16: bool = False, micro_batch: int = 4, accumulation: int = 1, **extra) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # gather and release every parameter
    if bf16:
        config["bf16"] = {"enabled": True}
    config.update(extra)
    return config


def training_command(workdir: Path, accelerator: Optional[str], config: dict, num_procs: int = 1, steps: int = 20,
                     extra_env: Optional[dict] = None, train_args=()) -> Tuple[List[str], dict, Path]:
    """The ``deepspeed`` command line of ``run_training``, its environment, and where rank 0's JSON goes."""
    workdir.mkdir(parents=True, exist_ok=True)
    label = accelerator or "default"
    config_path = workdir / f"{label}-config.json"
    config_path.write_text(json.dumps(config))
    out = workdir / f"{label}-losses.json"
    env = clean_env(DS_ACCELERATOR=accelerator, **(extra_env or {}))
    if accelerator == "cpu":
        env["LOCAL_SIZE"] = str(num_procs)  # DeepSpeed's CPU accelerator counts "devices" from it
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(num_procs), "--master_port", str(free_port()),
           str(TRAIN), "--deepspeed_config", str(config_path), "--steps", str(steps), "--losses-out", str(out),
           *train_args]
    return cmd, env, out


def remove_cpu_comm_buffers(master_port: str) -> None:
    """DeepSpeed's CPU accelerator leaves a 69 MB shared-memory all-reduce buffer per rank in /dev/shm
    (named after the master port) when its processes exit; a test run would pile up gigabytes of RAM."""
    for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{master_port}_*"):
        buffer.unlink(missing_ok=True)


def run_training(workdir: Path, accelerator: Optional[str], config: dict, num_procs: int = 1, steps: int = 20,
                 extra_env: Optional[dict] = None, timeout: float = 600, train_args=()) -> dict:
    """``DS_ACCELERATOR=<accelerator> deepspeed --num_gpus N scripts/train.py``; returns rank 0's JSON, with the
    other ranks' JSON under ``"other_ranks"``.

    ``accelerator=None`` leaves DS_ACCELERATOR unset. Files go to ``<workdir>/<accelerator>-*.json``.
    """
    cmd, env, out = training_command(workdir, accelerator, config, num_procs, steps, extra_env, train_args)
    try:
        proc = run_command(cmd, timeout, cwd=workdir, env=env)
    finally:
        remove_cpu_comm_buffers(cmd[cmd.index("--master_port") + 1])
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    result["other_ranks"] = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(1, num_procs)]
    return result


def ranks(result: dict) -> List[dict]:
    """Every rank's JSON of a ``run_training`` result, by rank."""
    return [result, *result["other_ranks"]]


class Trainings:
    """``run_training`` runs shared by the tests of a session (the ``trainings`` fixture): each distinct run (the
    same accelerator, config, processes, steps, arguments and environment) runs once, the first time a test asks
    for it, and later tests get the same result. Results are shared: tests must not modify them."""

    def __init__(self, root: Path):
        self.root = root
        self._runs: Dict[str, Future] = {}
        self._lock = threading.Lock()

    def run(self, accelerator: Optional[str], config: dict, num_procs: int = 1, steps: int = 20,
            train_args: Sequence[str] = (), extra_env: Optional[dict] = None, save_at: Sequence[int] = (),
            dump_hlo: bool = False) -> dict:
        """``run_training``'s result. ``save_at``: steps after which it saves a checkpoint into its
        ``result["save_dir"]``; ``dump_hlo``: XLA writes the HLO of every graph it compiles into ``result["hlo_dir"]``."""
        key = json.dumps([accelerator, config, num_procs, steps, list(train_args), extra_env or {}, list(save_at),
                          dump_hlo], sort_keys=True, default=str)
        with self._lock:
            future, owner = self._runs.get(key), False
            if future is None:
                future, owner = self._runs.setdefault(key, Future()), True
                workdir = self.root / f"run{len(self._runs)}"
        if owner:
            try:
                future.set_result(self._train(workdir, accelerator, config, num_procs, steps, train_args,
                                              dict(extra_env or {}), save_at, dump_hlo))
            except BaseException as exc:  # every test waiting on this run fails with the same error
                future.set_exception(exc)
        return future.result()

    @staticmethod
    def _train(workdir, accelerator, config, num_procs, steps, train_args, extra_env, save_at, dump_hlo) -> dict:
        train_args = list(train_args)
        if save_at:
            train_args += ["--save-dir", str(workdir / "checkpoints"), "--save-at", *map(str, save_at)]
        if dump_hlo:
            flags = extra_env.get("XLA_FLAGS", FAST_COMPILE["XLA_FLAGS"])
            extra_env["XLA_FLAGS"] = f"{flags} --xla_dump_to={workdir / 'hlo'} --xla_dump_hlo_as_text"
        result = run_training(workdir, accelerator, config, num_procs, steps, extra_env, train_args=train_args)
        return {**result, "save_dir": workdir / "checkpoints" if save_at else None,
                "hlo_dir": workdir / "hlo" if dump_hlo else None}

    def against_cpu(self, config: dict, dump_hlo: bool = False, **kwargs) -> Tuple[dict, dict]:
        """The same training on XLA (with ``dump_hlo``) and on DeepSpeed's CPU accelerator, run concurrently;
        ``(xla, cpu)``. ``kwargs`` go to ``run`` for both."""
        with ThreadPoolExecutor(max_workers=2) as pool:
            xla = pool.submit(self.run, "xla", config, dump_hlo=dump_hlo, **kwargs)
            cpu = pool.submit(self.run, "cpu", config, **kwargs)
            return xla.result(), cpu.result()


def counts_per_step(result: dict) -> dict:
    """After ``scripts/train.py``'s warm-up: XLA compilations (in all), executions and device->host transfers per step."""
    warm, end = result["counters"]["warm"], result["counters"]["end"]
    steps = len(result["losses"]) - WARMUP_STEPS
    return {key: (end[key] - warm[key]) / (1 if key == "compilations" else steps) for key in end}


# How close a run on XLA must come to the same run on DeepSpeed's CPU accelerator. Losses: fp32 absolute (they are
# ~1-4); bf16 relative to the CPU run's value, since a bf16 number is only as exact as a fraction of itself. Final
# weights, element by element: fp32 runs differ by float32 round-off (measured: at most 1.4e-6); bf16 runs by a
# bf16 step of a weight (1/128 of it: 7.8e-3 for LayerNorm's ~1.0) and, on weights with small gradients, by the
# few Adam steps (lr 3e-3 each) their bf16 gradients' rounding turned the other way (measured: at most 5e-3).
LOSS_TOLERANCE = {"float32": {"atol": 1e-4, "rtol": 0.0}, "bfloat16": {"atol": 0.0, "rtol": 5e-3}}
PARAM_TOLERANCE = {"float32": {"atol": 1e-5, "rtol": 1e-4}, "bfloat16": {"atol": 1.5e-2, "rtol": 1 / 64}}
# The key biases (the middle third of each ``qkv.bias`` in scripts/train.py's model) get no gradient: the softmax
# ignores a constant added to every key, so theirs is round-off, which Adam scales up to full steps of lr in
# arbitrary directions. Two implementations disagree there by up to 2 x lr x steps (train.py: 3e-3, <= 20 steps).
KEY_BIAS_ATOL = 2 * 3e-3 * 20 + 1e-3


def training_dtype(config: dict) -> str:
    """The dtype a DeepSpeed config trains the model's weights in."""
    return "bfloat16" if config.get("bf16", {}).get("enabled") else "float32"


def within(actual, expected, atol: float, rtol: float) -> bool:
    """|actual - expected| <= atol + rtol * |expected|, element by element (numbers or nested lists)."""
    import torch
    actual, expected = torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    return actual.shape == expected.shape and bool(((actual - expected).abs() <= atol + rtol * expected.abs()).all())


def assert_trains_like(xla: dict, cpu: dict, dtype: str, loss_tolerance: Optional[dict] = None) -> None:
    """``xla`` and ``cpu`` (``run_training`` results of one training) agree: rank 0's per-step losses, and every
    rank's final weights, which both hold in ``dtype`` (the module's weights DeepSpeed trains, not fp32 masters)."""
    import torch
    assert (xla["accelerator"], cpu["accelerator"]) == ("xla", "cpu")
    assert xla["world_size"] == cpu["world_size"] and xla["first_step"] == cpu["first_step"]
    assert len(xla["losses"]) == len(cpu["losses"]) > 0 and all(map(math.isfinite, xla["losses"])), xla["losses"]
    tolerance = loss_tolerance or LOSS_TOLERANCE[dtype]
    assert within(xla["losses"], cpu["losses"], **tolerance), (
        f"losses differ beyond {tolerance}:\nxla {xla['losses']}\ncpu {cpu['losses']}")
    for mine, theirs in zip(ranks(xla), ranks(cpu), strict=True):
        rank = mine["rank"]
        assert mine["params"].keys() == theirs["params"].keys(), rank
        assert set(mine["param_dtypes"].values()) == set(theirs["param_dtypes"].values()) == {dtype}, (
            rank, mine["param_dtypes"], theirs["param_dtypes"])
        for name, values in mine["params"].items():
            values, expected = torch.tensor(values, dtype=torch.float64), torch.tensor(theirs["params"][name],
                                                                                        dtype=torch.float64)
            if dtype == "bfloat16":  # the JSON holds floats: they must be bf16 numbers
                assert torch.equal(values.bfloat16().double(), values), f"rank {rank}: {name} is not bf16"
            assert values.shape == expected.shape, (rank, name)
            atol = torch.full_like(expected, PARAM_TOLERANCE[dtype]["atol"])
            if name.endswith("qkv.bias"):
                third = len(expected) // 3
                atol[third:2 * third] = KEY_BIAS_ATOL
            differs = (values - expected).abs() > atol + PARAM_TOLERANCE[dtype]["rtol"] * expected.abs()
            assert not differs.any(), (f"rank {rank}: {name} differs at {differs.nonzero().flatten().tolist()[:5]}: "
                                       f"{values[differs].tolist()[:5]} vs {expected[differs].tolist()[:5]}")
