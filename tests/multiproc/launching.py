"""``scripts/train.py`` and other scripts through the real launchers (``deepspeed``, ``torchrun``, ``accelerate``) or
forked ranks on either accelerator: their commands, configs and environments, and the results read back."""
import json
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from deepspeed_xla.launch_env import free_port
from tests.conftest import REPO, VENV_BIN, clean_env
from tests.multiproc.commands import job_port, remove_cpu_comm_buffers, run_command
from tests.multiproc.forking import run_ranks

TRAIN = REPO / "scripts" / "train.py"
TRAIN_MANY = REPO / "tests" / "train_many.py"
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


def train_arguments(workdir: Path, label: str, config: dict, steps: int, train_args=()) -> Tuple[List[str], Path]:
    """``scripts/train.py``'s arguments for one training whose files go to ``workdir/<label>-*.json``, and where rank
    0's JSON goes."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / f"{label}-config.json"
    config_path.write_text(json.dumps(config))
    out = workdir / f"{label}-losses.json"
    return ["--deepspeed_config", str(config_path), "--steps", str(steps), "--losses-out", str(out),
            "--read-loss-every-step", *train_args], out


def accelerator_env(accelerator: Optional[str], num_procs: int) -> dict:
    """The variables a launched run on ``accelerator`` gets: DS_ACCELERATOR and, for DeepSpeed's CPU accelerator, the
    "device" count it reads (LOCAL_SIZE) and one torch thread per rank, what DeepSpeed's ``--bind_cores_to_rank``
    sets on a 2-core machine. With a thread per core in every rank, the ranks' OpenMP threads spin against each other
    and the XLA side's processes: a CPU-accelerator step of a 2-rank run takes 10x longer."""
    if accelerator != "cpu":
        return {"DS_ACCELERATOR": accelerator}
    return {"DS_ACCELERATOR": accelerator, "LOCAL_SIZE": num_procs, "OMP_NUM_THREADS": 1}


def launch_command(script: Sequence[str], accelerator: Optional[str], num_procs: int = 1,
                   extra_env: Optional[dict] = None, launcher: str = "deepspeed",
                   launcher_args: Sequence[str] = ()) -> Tuple[List[str], dict]:
    """The command that starts ``script`` (a Python file and its arguments) on ``num_procs`` ranks, and its
    environment.

    ``launcher``: ``deepspeed``, ``torchrun``, ``accelerate`` (``accelerate launch``; ``launcher_args`` name its
    ``--config_file``, which sets the number of processes) or ``python`` (one process), which starts ``python
    script`` itself, without the ``deepspeed`` runner and its launcher: on XLA the way a user without a launcher
    does; DeepSpeed's CPU accelerator, which looks for MPI without them, gets the variables a launcher sets for one
    rank.
    """
    env, port = clean_env(**{**accelerator_env(accelerator, num_procs), **(extra_env or {})}), str(free_port())
    script = [*map(str, launcher_args), *map(str, script)]
    if launcher == "python":
        assert num_procs == 1, "launcher='python' starts one process"
        if accelerator == "cpu":
            env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        return [sys.executable, *script], env
    if launcher == "torchrun":
        return [str(VENV_BIN / "torchrun"), "--nproc_per_node", str(num_procs), "--master_port", port, *script], env
    if launcher == "accelerate":
        return [str(VENV_BIN / "accelerate"), "launch", "--main_process_port", port, *script], env
    assert launcher == "deepspeed", launcher
    return [str(VENV_BIN / "deepspeed"), "--num_gpus", str(num_procs), "--master_port", port, *script], env


def training_command(workdir: Path, accelerator: Optional[str], config: dict, num_procs: int = 1, steps: int = 20,
                     extra_env: Optional[dict] = None, train_args=(),
                     launcher: str = "deepspeed") -> Tuple[List[str], dict, Path]:
    """The command line of ``run_training``, its environment, and where rank 0's JSON goes."""
    args, out = train_arguments(workdir, accelerator or "default", config, steps, train_args)
    return (*launch_command([TRAIN, *args], accelerator, num_procs, extra_env, launcher), out)


def run_job(cmd: List[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a ``launch_command`` to its end; it must succeed."""
    port = job_port(cmd, env)
    try:
        proc = run_command(cmd, timeout, cwd=cwd, env=env)
    finally:
        if port:
            remove_cpu_comm_buffers(port)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def read_results(out: Path, num_procs: int) -> dict:
    """Rank 0's JSON of a training, with the other ranks' JSON under ``"other_ranks"``."""
    result = json.loads(out.read_text())
    result["other_ranks"] = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(1, num_procs)]
    return result


def run_training(workdir: Path, accelerator: Optional[str], config: dict, num_procs: int = 1, steps: int = 20,
                 extra_env: Optional[dict] = None, timeout: float = 600, train_args=(),
                 launcher: str = "deepspeed") -> dict:
    """``DS_ACCELERATOR=<accelerator> deepspeed --num_gpus N scripts/train.py`` (or ``launch_command``'s other
    ``launcher``); returns ``read_results``.

    ``accelerator=None`` leaves DS_ACCELERATOR unset. Files go to ``<workdir>/<accelerator>-*.json``.
    """
    cmd, env, out = training_command(workdir, accelerator, config, num_procs, steps, extra_env, train_args, launcher)
    run_job(cmd, env, workdir, timeout)
    return read_results(out, num_procs)


def ranks(result: dict) -> List[dict]:
    """Every rank's JSON of a ``run_training`` result, by rank."""
    return [result, *result["other_ranks"]]


def run_forked_job(target: str, accelerator: str, world_size: int, extra_env: Optional[dict] = None,
                   timeout: float = 600, after_import: Sequence[str] = (), args: Sequence[str] = ()) -> None:
    """``run_ranks(target)`` on ``accelerator`` with the variables a launched run gets (``accelerator_env``); every
    rank must succeed."""
    env = {**accelerator_env(accelerator, world_size), **(extra_env or {})}
    procs = run_ranks(target, world_size, env=env, timeout=timeout, after_import=after_import, args=args)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"{accelerator} rank {rank} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
