"""Multi-process helpers: N ranks of one function (env:// rendezvous), and ``scripts/train.py``
through the real ``deepspeed`` CLI with its per-step losses read back."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Tuple

from tests.conftest import REPO, VENV_BIN, clean_env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ranks(target: str, world_size: int, env: Optional[dict] = None) -> Tuple[list, list]:
    """Start ``target`` ("module:function", importable from the repo root) once per rank, env:// rendezvous.

    Returns the processes and their (stdout, stderr) files: files, not pipes, since a rank blocked on a
    full pipe would stall its peers. ``env`` may set ``MASTER_PORT`` (to find the run's files afterwards).
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
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=rank_env, stdout=out, stderr=err))
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
                other.kill()
            proc.wait()
            note = f"\n[rank {rank} killed: the ranks did not finish within {timeout:.0f} s]"
        out.seek(0)
        err.seek(0)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read() + note))
        out.close()
        err.close()
    return results


TRAIN = REPO / "scripts" / "train.py"
WARMUP_STEPS = 3  # scripts/train.py's default --warmup-steps


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
    """``DS_ACCELERATOR=<accelerator> deepspeed --num_gpus N scripts/train.py``; returns rank 0's JSON.

    ``accelerator=None`` leaves DS_ACCELERATOR unset. Files go to ``<workdir>/<accelerator>-*.json``.
    """
    cmd, env, out = training_command(workdir, accelerator, config, num_procs, steps, extra_env, train_args)
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        remove_cpu_comm_buffers(cmd[cmd.index("--master_port") + 1])
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def run_against_cpu(workdir: Path, config: dict, **kwargs) -> Tuple[dict, dict]:
    """The same training on XLA and on DeepSpeed's CPU accelerator, run concurrently; ``(xla, cpu)``."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [pool.submit(run_training, workdir / name, name, config, **kwargs) for name in ("xla", "cpu")]
        return runs[0].result(), runs[1].result()


def counts_per_step(result: dict) -> dict:
    """After ``scripts/train.py``'s warm-up: XLA compilations (in all), executions and device->host transfers per step."""
    warm, end = result["counters"]["warm"], result["counters"]["end"]
    steps = len(result["losses"]) - WARMUP_STEPS
    return {key: (end[key] - warm[key]) / (1 if key == "compilations" else steps) for key in end}


def max_abs_diff(a, b) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))
