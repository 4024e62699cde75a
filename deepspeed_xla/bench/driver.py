"""Running the systems: one command per system (the ``deepspeed`` CLI, or a worker), each in its own session."""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

from deepspeed_xla.bench import collective_bytes
from deepspeed_xla.bench.results import bandwidth_summary, cost_summary, summarize
from deepspeed_xla.bench.systems import LR, WEIGHT_DECAY, System, ds_config, train_flags
from deepspeed_xla.launch_env import free_port


def deepspeed_command(procs: int, target: Sequence[str]) -> List[str]:
    """The ``deepspeed`` CLI of this interpreter, on ``procs`` local processes."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(procs),
            "--master_port", str(free_port()), *target]


def child_env(accelerator: str, procs: int) -> dict:
    env = dict(os.environ)
    if accelerator in ("xla", "cpu"):
        env["DS_ACCELERATOR"] = accelerator
    if accelerator == "cpu":
        env["LOCAL_SIZE"] = str(procs)  # DeepSpeed's CPU accelerator counts its "devices" from it
    return env


def run(cmd: List[str], env: dict, log: Path, timeout: float) -> Optional[str]:
    """Run ``cmd`` with its output in ``log``; why it failed, or None. A timeout ends its whole process group."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"did not finish within {timeout:.0f} s (log: {log})"
    if code:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        return f"exit code {code} (log: {log}):\n{tail}"
    return None


def read_ranks(path: Path, procs: int) -> List[dict]:
    """train.py's JSON: rank 0 at ``path``, rank r at ``path.rank<r>``."""
    return [json.loads((path if rank == 0 else Path(f"{path}.rank{rank}")).read_text()) for rank in range(procs)]


def train_arguments(args: argparse.Namespace, train_script: Path, config: Path, out: Path,
                    system: System) -> List[str]:
    """``scripts/train.py`` with ``--timings`` on the bench's model and steps, and the flags of the system's
    feature."""
    return [str(train_script), "--deepspeed_config", str(config), "--timings", "--losses-out", str(out),
            "--steps", str(args.steps), "--warmup-steps", str(args.warmup), "--dim", str(args.dim),
            "--layers", str(args.layers), "--seq", str(args.seq), "--vocab", str(args.vocab),
            "--seed", str(args.seed), *train_flags(system)]


def trainer_arguments(args: argparse.Namespace, train_script: Path, config: Path, out: Path,
                      workdir: Path) -> List[str]:
    """``scripts/hf_train.py`` (beside ``train_script``) training train.py's model on the same config and batches'
    sizes: the Trainer's own values are the config's (HF refuses a mismatch), a constant learning rate as in
    train.py, the loss logged once at the end, each step waited for."""
    return [str(train_script.with_name("hf_train.py")), "--model", "tinygpt", "--timings", "true",
            "--deepspeed", str(config), "--results_out", str(out), "--output_dir", str(workdir / "hf_output"),
            "--max_steps", str(args.steps), "--bench_warmup", str(args.warmup),
            "--per_device_train_batch_size", str(args.batch), "--gradient_accumulation_steps", str(args.grad_accum),
            "--learning_rate", str(LR), "--weight_decay", str(WEIGHT_DECAY), "--lr_scheduler_type", "constant",
            "--max_grad_norm", str(args.clip),
            "--logging_steps", str(args.steps), "--save_strategy", "no", "--report_to", "none",
            "--dim", str(args.dim), "--layers", str(args.layers), "--seq", str(args.seq), "--vocab", str(args.vocab),
            "--samples", str(args.steps * args.batch * 64), "--seed", str(args.seed)]


def run_system(system: System, args: argparse.Namespace, train_script: Path, workdir: Path,
               peak_flops: Optional[float]) -> dict:
    out, log = workdir / f"{system.name}.json", workdir / f"{system.name}.log"
    if system.accelerator == "floor":
        cmd = [sys.executable, "-m", "deepspeed_xla.bench", "--worker", "floor", "--worker-out", str(out),
               "--train-script", str(train_script), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--dim", str(args.dim), "--layers", str(args.layers), "--seq", str(args.seq),
               "--batch", str(args.batch), "--vocab", str(args.vocab), "--seed", str(args.seed),
               "--grad-accum", str(args.grad_accum), "--clip", str(args.clip)]
    else:
        config = workdir / f"{system.name}.config.json"
        outputs = workdir / system.name
        config.write_text(json.dumps(ds_config(system.stage, args.batch, args.zero, system.feature, outputs,
                                               accum=args.grad_accum, clip=args.clip)))
        target = (trainer_arguments(args, train_script, config, out, workdir) if system.trainer
                  else train_arguments(args, train_script, config, out, system))
        cmd = deepspeed_command(system.procs, target)
    env = child_env(system.accelerator, system.procs)
    dumps = workdir / f"{system.name}.hlo" if args.cost and system.accelerator != "cpu" else None
    if dumps:  # the ranks' modules, in one folder: ZeRO's data-parallel ranks compile the same step graph
        shutil.rmtree(dumps, ignore_errors=True)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dumps} --xla_dump_hlo_as_text".strip()
    counted = collective_bytes.counting(env, system, args, workdir)  # the HLO of xla_host's steps holds none
    print(f"[bench] {system.name} ...", file=sys.stderr, flush=True)
    launched = time.time()
    error = run(cmd, env, log, args.timeout)
    load = os.getloadavg()[0]  # the last minute of this system's run, its own processes included
    if error:
        print(f"[bench] {system.name} failed: {error}", file=sys.stderr, flush=True)
        return {"system": system.name, "error": error}
    row = dict(summarize(system, read_ranks(out, system.procs), args, peak_flops, launched), load_average=load)
    if dumps:
        row["cost"] = cost_summary(system, dumps, args, row["executions_per_step"])
    collective_bytes.attach(row, counted, system, args)
    return row


def run_bandwidth(args: argparse.Namespace, workdir: Path) -> dict:
    out, log = workdir / "bandwidth.json", workdir / "bandwidth.log"
    cmd = deepspeed_command(2, ["--no_local_rank", "--module", "deepspeed_xla.bench", "--worker", "bandwidth",
                                "--worker-out", str(out), "--bandwidth-mb", str(args.bandwidth_mb),
                                "--bandwidth-iters", str(args.bandwidth_iters)])
    print("[bench] all-reduce bandwidth ...", file=sys.stderr, flush=True)
    error = run(cmd, child_env("xla", 2), log, args.timeout)
    if error:
        print(f"[bench] all-reduce bandwidth failed: {error}", file=sys.stderr, flush=True)
        return {"error": error}
    return bandwidth_summary(json.loads(out.read_text()))
