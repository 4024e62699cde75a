"""Run ``scripts/train.py`` through the real ``deepspeed`` CLI and read back its per-step losses."""
import json
import socket
import subprocess
from pathlib import Path
from typing import Optional

from tests.conftest import REPO, VENV_BIN, clean_env

TRAIN = REPO / "scripts" / "train.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ds_config(stage: int, bf16: bool = False, micro_batch: int = 4, accumulation: int = 1, **extra) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    config.update(extra)
    return config


def run_training(workdir: Path, accelerator: str, config: dict, num_procs: int = 1, steps: int = 20,
                 extra_env: Optional[dict] = None, timeout: float = 600, train_args=()) -> dict:
    """``DS_ACCELERATOR=<accelerator> deepspeed --num_gpus N scripts/train.py``; returns the losses JSON."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / f"{accelerator}-config.json"
    config_path.write_text(json.dumps(config))
    out = workdir / f"{accelerator}-losses.json"
    env = clean_env(DS_ACCELERATOR=accelerator, **(extra_env or {}))
    if accelerator == "cpu":
        env["LOCAL_SIZE"] = str(num_procs)  # DeepSpeed's CPU accelerator counts "devices" from it
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(num_procs), "--master_port", str(free_port()),
           str(TRAIN), "--deepspeed_config", str(config_path), "--steps", str(steps), "--losses-out", str(out),
           *train_args]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def max_abs_diff(a, b) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))
