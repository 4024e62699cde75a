"""Benchmark: a GPT-style decoder trained by a hand-written torch_xla loop (the floor), by DeepSpeed through
deepspeed_xla (ZeRO 0-3 on 1 and on 2 processes) and by DeepSpeed's own CPU accelerator, in one table.

    PJRT_DEVICE=CPU python -m deepspeed_xla.bench                            # every system, the default small GPT
    python -m deepspeed_xla.bench --steps 20 --out bench.json --png bench.png
    python -m deepspeed_xla.bench --systems floor xla-zero2-1p xla-zero3-2p --skip-bandwidth
    PJRT_DEVICE=TPU python -m deepspeed_xla.bench --dim 1024 --layers 8 --seq 1024 --batch 8   # adds MFU

Run it from a deepspeed-xla checkout: a DeepSpeed system is ``deepspeed --num_gpus N scripts/train.py --timings``
(the example, launched as users launch it), and the floor trains the same TinyGPT on the same batches with
torch.optim.AdamW of the same hyper-parameters, one ``torch_xla.sync()`` per step. Every system runs in processes
of its own, one system after another, so that no process holds the device while another needs it. The bench also
times a 64 MB all-reduce between 2 processes on the device's comm path against gloo on CPU tensors, and compares
ZeRO-3's device bytes per rank on 2 processes with 1. docs/performance.md explains the columns and the FLOPs
formula, and records a run.
"""
import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

LR, WEIGHT_DECAY = 0.003, 0.01  # scripts/configs/*.json and train.py --client-optimizer
SYSTEM_NAME = re.compile(r"(xla|cpu)-zero([0-3])-([1-9][0-9]*)p$")
DEFAULT_SYSTEMS = ["floor", *(f"xla-zero{stage}-{procs}p" for procs in (1, 2) for stage in range(4)), "cpu-zero0-1p"]
RATIO_TARGETS = {0: 1.10, 1: 1.10, 2: 1.10, 3: 1.25}  # step time of xla-zero<stage>-1p over the floor's
BANDWIDTH_TARGET = 0.8  # device all-reduce bandwidth over gloo's
PARTITION_TARGET = 0.55  # ZeRO-3 device bytes per rank, 2 processes over 1


@dataclass(frozen=True)
class System:
    """One row: ``floor``, or DeepSpeed on accelerator ``xla``/``cpu`` at a ZeRO stage on ``procs`` processes."""
    name: str
    accelerator: str
    stage: int = 0
    procs: int = 1


def parse_system(name: str) -> System:
    if name == "floor":
        return System(name, "floor")
    match = SYSTEM_NAME.match(name)
    if not match:
        raise argparse.ArgumentTypeError(f"unknown system {name!r}: name floor or <xla|cpu>-zero<0-3>-<N>p, "
                                         "e.g. xla-zero3-2p (ZeRO-3 on 2 XLA processes)")
    return System(name, match[1], int(match[2]), int(match[3]))


def matmul_params(dim: int, layers: int, vocab: int) -> int:
    """TinyGPT's parameters without its token and position embeddings (look-ups, which multiply nothing)."""
    block = 12 * dim * dim + 13 * dim  # qkv, proj and the 4x MLP (weights and biases), two LayerNorms
    return layers * block + 2 * dim + dim * vocab + vocab  # the final LayerNorm and the vocabulary head


def flops_per_token(dim: int, layers: int, vocab: int, seq: int) -> int:
    """Training FLOPs per token: 6 N (forward and backward through the N multiplied parameters) plus
    12 L T d (attention scores and weighted values over the full T x T, causal mask not discounted)."""
    return 6 * matmul_params(dim, layers, vocab) + 12 * layers * seq * dim


def ds_config(stage: int, batch: int, zero_options: Optional[dict] = None) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition every parameter, as a large model's are
    zero.update(zero_options or {})
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": zero, "steps_per_print": 10 ** 9}


def zero_option(text: str):
    """``KEY=JSON`` of ``--zero``: one zero_optimization setting."""
    key, sep, value = text.partition("=")
    try:
        if key and sep:
            return key, json.loads(value)
    except json.JSONDecodeError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: give KEY=JSON, e.g. contiguous_gradients=true or "
                                     "reduce_bucket_size=5e7")


def find_train_script(explicit: Optional[str]) -> Path:
    """scripts/train.py: from ``--train-script``, the working directory, or the checkout this package runs from."""
    candidates = [Path(explicit)] if explicit else [Path.cwd() / "scripts" / "train.py",
                                                   Path(__file__).resolve().parents[1] / "scripts" / "train.py"]
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise SystemExit(f"deepspeed_xla.bench trains the model of a deepspeed-xla checkout's scripts/train.py, which is "
                     f"not at {' or '.join(map(str, candidates))}: run it from the repository root or pass "
                     "--train-script PATH/TO/train.py.")


# ---- workers: each runs in a process of its own ------------------------------------------------------------------

def _load_train_module(path: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location("deepspeed_xla_bench_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _peak_rss_bytes() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def floor_worker(args: argparse.Namespace) -> None:
    """System (a): train.py's model, rank-0 batches and seed, torch.optim.AdamW, one graph cut per step; the
    result has the fields of train.py's ``--losses-out`` JSON."""
    train = _load_train_module(args.train_script)
    import torch
    from deepspeed_xla import xla_runtime
    xla_runtime.torch_xla()
    device = xla_runtime.device()
    torch.manual_seed(args.seed)
    model = train.TinyGPT(args.vocab, args.dim, args.layers, seq=args.seq).to(device)
    # foreach: the multi-tensor form that deepspeed_xla's FusedAdam uses too
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    losses, step_times, counters = [], [], {}
    for step in range(args.steps):
        if step == args.warmup:
            counters["warm"] = xla_runtime.graph_counters()
        start = time.perf_counter()
        tokens, targets = train.make_batch(step, 0, args.batch, args.seq, args.vocab)
        loss = model(tokens.to(device), targets.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        xla_runtime.sync(wait=True)
        step_times.append(time.perf_counter() - start)
    counters["end"] = xla_runtime.graph_counters()
    state = [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
    result = {"world_size": 1, "rank": 0, "counters": counters, "step_times": step_times,
              "device_bytes": xla_runtime.live_device_bytes(), "peak_rss_bytes": _peak_rss_bytes(),
              "state_bytes": sum(t.numel() * t.element_size() for t in state),
              "losses": [float(loss) for loss in losses]}
    Path(args.worker_out).write_text(json.dumps(result))


def bandwidth_worker(args: argparse.Namespace) -> None:
    """One rank of the all-reduce comparison (under ``deepspeed --num_gpus 2``): a device tensor through DeepSpeed's
    backend for this device type (PJRT CPU: the host-staged ``xla_host``) against gloo on a CPU tensor."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    deepspeed.init_distributed()
    accelerator = get_accelerator()
    gloo = dist.new_group(backend="gloo")
    numel = args.bandwidth_mb * 2 ** 20 // 4
    on_device, on_host = torch.ones(numel, device=accelerator.current_device_name()), torch.ones(numel)

    def timed(tensor: torch.Tensor, group=None) -> float:
        dist.barrier(group=gloo)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        if tensor is on_device:
            accelerator.synchronize()
        return time.perf_counter() - start

    # The first round connects the ranks and compiles the transfers; sums of ones stay exact in float32.
    rounds = [(timed(on_device), timed(on_host, gloo)) for _ in range(args.bandwidth_iters + 1)][1:]
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps({
            "bytes": numel * 4, "backend": dist.get_backend(), "device_seconds": [r[0] for r in rounds],
            "gloo_seconds": [r[1] for r in rounds]}))


WORKERS: Dict[str, Callable[[argparse.Namespace], None]] = {"floor": floor_worker, "bandwidth": bandwidth_worker}


# ---- the driver: starts the systems, summarizes their JSON -------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepspeed_command(procs: int, target: Sequence[str]) -> List[str]:
    """The ``deepspeed`` CLI of this interpreter, on ``procs`` local processes."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(procs),
            "--master_port", str(_free_port()), *target]


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


def summarize(system: System, ranks: List[dict], args: argparse.Namespace, peak_flops: Optional[float]) -> dict:
    """One table row from every rank's JSON: a step lasts as long as its slowest rank; counts are the worst rank's."""
    step_times = [max(times) for times in zip(*(rank["step_times"] for rank in ranks))][args.warmup:]
    median_step = statistics.median(step_times)
    tokens_per_s = system.procs * args.batch * args.seq / median_step
    row = {"system": system.name, "accelerator": system.accelerator, "zero_stage": system.stage,
           "processes": system.procs, "median_step_s": median_step, "tokens_per_s": tokens_per_s,
           "peak_rss_bytes": max(rank["peak_rss_bytes"] for rank in ranks), "final_loss": ranks[0]["losses"][-1],
           "state_bytes_per_rank": max(rank["state_bytes"] for rank in ranks),
           "compilations_after_warmup": None, "executions_per_step": None, "transfers_per_step": None,
           "device_bytes_per_rank": None, "mfu": None}
    if all(rank["counters"].get("end") for rank in ranks):  # XLA: counters at the end of warm-up and of training
        steady = args.steps - args.warmup
        deltas = [{key: rank["counters"]["end"][key] - rank["counters"]["warm"][key] for key in rank["counters"]["end"]}
                  for rank in ranks]
        row.update(compilations_after_warmup=max(d["compilations"] for d in deltas),
                   executions_per_step=max(d["executions"] for d in deltas) / steady,
                   transfers_per_step=max(d["transfers_to_host"] for d in deltas) / steady,
                   device_bytes_per_rank=max(rank["device_bytes"] for rank in ranks))
        if peak_flops:
            flops = flops_per_token(args.dim, args.layers, args.vocab, args.seq)
            row["mfu"] = flops * tokens_per_s / (system.procs * peak_flops)
    return row


def run_system(system: System, args: argparse.Namespace, train_script: Path, workdir: Path,
               peak_flops: Optional[float]) -> dict:
    out, log = workdir / f"{system.name}.json", workdir / f"{system.name}.log"
    if system.accelerator == "floor":
        cmd = [sys.executable, "-m", "deepspeed_xla.bench", "--worker", "floor", "--worker-out", str(out),
               "--train-script", str(train_script), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--dim", str(args.dim), "--layers", str(args.layers), "--seq", str(args.seq),
               "--batch", str(args.batch), "--vocab", str(args.vocab), "--seed", str(args.seed)]
    else:
        config = workdir / f"{system.name}.config.json"
        config.write_text(json.dumps(ds_config(system.stage, args.batch, args.zero)))
        cmd = deepspeed_command(system.procs, [
            str(train_script), "--deepspeed_config", str(config), "--timings", "--losses-out", str(out),
            "--steps", str(args.steps), "--warmup-steps", str(args.warmup), "--dim", str(args.dim),
            "--layers", str(args.layers), "--seq", str(args.seq), "--vocab", str(args.vocab),
            "--seed", str(args.seed)])
    print(f"[bench] {system.name} ...", file=sys.stderr, flush=True)
    error = run(cmd, child_env(system.accelerator, system.procs), log, args.timeout)
    load = os.getloadavg()[0]  # the last minute of this system's run, its own processes included
    if error:
        print(f"[bench] {system.name} failed: {error}", file=sys.stderr, flush=True)
        return {"system": system.name, "error": error}
    return dict(summarize(system, read_ranks(out, system.procs), args, peak_flops), load_average=load)


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


def bandwidth_summary(result: dict) -> dict:
    device, gloo = statistics.median(result["device_seconds"]), statistics.median(result["gloo_seconds"])
    return {"bytes": result["bytes"], "backend": result["backend"], "device_gb_per_s": result["bytes"] / device / 1e9,
            "gloo_gb_per_s": result["bytes"] / gloo / 1e9, "ratio": gloo / device}


def zero3_partition(rows: List[dict]) -> Optional[dict]:
    """ZeRO-3's parameter and optimizer-state bytes per rank on 2 processes over 1, and the same for all live
    device buffers (None unless both ran)."""
    by_name = {row["system"]: row for row in rows if "error" not in row}
    one, two = by_name.get("xla-zero3-1p"), by_name.get("xla-zero3-2p")
    if not (one and two):
        return None
    return {"bytes_1_process": one["state_bytes_per_rank"], "bytes_per_rank_2_processes": two["state_bytes_per_rank"],
            "ratio": two["state_bytes_per_rank"] / one["state_bytes_per_rank"],
            "device_bytes_ratio": two["device_bytes_per_rank"] / one["device_bytes_per_rank"]}


def add_floor_ratios(rows: List[dict]) -> None:
    floor = next((row for row in rows if row["system"] == "floor" and "error" not in row), None)
    for row in rows:
        if floor and "error" not in row:
            row["ratio_to_floor"] = row["median_step_s"] / floor["median_step_s"]


def check_targets(report: dict) -> List[dict]:
    """Each target of the issue that this run measured: what, the value, the limit, and whether it is met."""
    checks = []

    def check(what: str, value, limit: str, met: bool) -> None:
        checks.append({"what": what, "value": value, "limit": limit, "met": met})

    for row in report["systems"]:
        if "error" in row or row["accelerator"] == "cpu":
            continue
        name, stage = row["system"], row["zero_stage"]
        if row["accelerator"] == "xla" and row["processes"] == 1 and "ratio_to_floor" in row:
            limit = RATIO_TARGETS[stage]
            check(f"{name} step time / floor", row["ratio_to_floor"], f"<= {limit}", row["ratio_to_floor"] <= limit)
        check(f"{name} compilations after warm-up", row["compilations_after_warmup"], "0",
              row["compilations_after_warmup"] == 0)
        if stage <= 2:
            check(f"{name} executions per step", row["executions_per_step"], "1", row["executions_per_step"] == 1)
        check(f"{name} device->host transfers per step", row["transfers_per_step"], "0",
              row["transfers_per_step"] == 0)
    bandwidth = report.get("bandwidth") or {}
    if "ratio" in bandwidth:
        check(f"all-reduce {bandwidth['bytes'] >> 20} MB, {bandwidth['backend']} / gloo bandwidth", bandwidth["ratio"],
              f">= {BANDWIDTH_TARGET}", bandwidth["ratio"] >= BANDWIDTH_TARGET)
    partition = report.get("zero3_partition")
    if partition:
        check("ZeRO-3 parameter + optimizer bytes per rank, 2 processes / 1", partition["ratio"],
              f"<= {PARTITION_TARGET}",
              partition["ratio"] <= PARTITION_TARGET)
    return checks


def _mb(value: float) -> str:
    return f"{value / 2 ** 20:.2f}"


COLUMNS = [  # header, row key, format of a present value
    ("system", "system", str),
    ("step ms", "median_step_s", lambda v: f"{v * 1e3:.1f}"),
    ("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
    ("compiles after warm-up", "compilations_after_warmup", str),
    ("executions/step", "executions_per_step", lambda v: f"{v:.2f}"),
    ("D->H transfers/step", "transfers_per_step", lambda v: f"{v:.2f}"),
    ("peak RSS MB", "peak_rss_bytes", lambda v: f"{v / 2 ** 20:.0f}"),
    ("state MB/rank", "state_bytes_per_rank", _mb),
    ("device MB/rank", "device_bytes_per_rank", _mb),
    ("x floor", "ratio_to_floor", lambda v: f"{v:.2f}"),
    ("MFU", "mfu", lambda v: f"{v:.1%}"),
    ("load", "load_average", lambda v: f"{v:.1f}"),
]


def format_table(rows: List[dict]) -> str:
    """The rows as a text table; '-' where a system has no such figure, the MFU column only where one has it."""
    columns = [c for c in COLUMNS if c[1] != "mfu" or any(row.get("mfu") is not None for row in rows)]
    cells = [[header for header, _, _ in columns]]
    for row in rows:
        cells.append([fmt(row[key]) if row.get(key) is not None else ("failed" if "error" in row and i == 1 else "-")
                      for i, (_, key, fmt) in enumerate(columns)])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                       for i, (cell, width) in enumerate(zip(line, widths))) for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def render(report: dict) -> str:
    """The whole printout: the setup, the table, the all-reduce and ZeRO-3 figures, the targets."""
    model, load = report["model"], report["load_average"]
    lines = [f"TinyGPT dim {model['dim']}, {model['layers']} layers, seq {model['seq']}, batch {model['batch']}/rank, "
             f"vocab {model['vocab']}: {model['flops_per_token']:,} FLOPs/token; {report['steps']} steps, medians "
             f"after {report['warmup']} warm-up; PJRT_DEVICE={report['device']}, {report['cpus']} CPUs, load average "
             f"{load['start']:.1f} -> {load['end']:.1f}"]
    if report.get("zero_options"):
        lines[0] += f"; zero_optimization {json.dumps(report['zero_options'])}"
    lines += ["", format_table(report["systems"])]
    bandwidth = report.get("bandwidth")
    if bandwidth and "ratio" in bandwidth:
        lines += ["", f"all-reduce of {bandwidth['bytes'] >> 20} MB, 2 processes: {bandwidth['backend']} on the device "
                      f"{bandwidth['device_gb_per_s']:.2f} GB/s, gloo on CPU tensors {bandwidth['gloo_gb_per_s']:.2f} "
                      f"GB/s (ratio {bandwidth['ratio']:.2f})"]
    partition = report.get("zero3_partition")
    if partition:
        lines += [f"ZeRO-3 parameters + optimizer state per rank: {_mb(partition['bytes_1_process'])} MB on 1 "
                  f"process, {_mb(partition['bytes_per_rank_2_processes'])} MB on 2 (ratio {partition['ratio']:.2f}; "
                  f"all live device buffers: ratio {partition['device_bytes_ratio']:.2f})"]
    if report["targets"]:
        lines += ["", "targets:"] + [
            f"  {'met' if t['met'] else 'MISSED':6}  {t['what']}: {t['value']:.3g} (target {t['limit']})"
            for t in report["targets"]]
    failures = [f"{row['system']}: {row['error']}" for row in report["systems"] if "error" in row]
    if bandwidth and "error" in bandwidth:
        failures.append(f"all-reduce bandwidth: {bandwidth['error']}")
    if failures:
        lines += ["", "failed:"] + failures
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Step time and tokens/s per system as a PNG; matplotlib is imported only here."""
    from matplotlib.figure import Figure  # a bare Figure renders with Agg: no display, no pyplot state
    rows = [row for row in report["systems"] if "error" not in row]
    names = [row["system"] for row in rows]
    figure = Figure(figsize=(11, 0.45 * len(rows) + 1.8), layout="constrained")
    times, tokens = figure.subplots(1, 2, sharey=True)
    times.barh(names, [row["median_step_s"] * 1e3 for row in rows], color="tab:blue")
    floor = next((row for row in rows if row["system"] == "floor"), None)
    if floor:
        times.axvline(floor["median_step_s"] * 1e3, color="black", linestyle="--", linewidth=1, label="floor")
        times.legend(loc="lower right")
    times.set(xlabel="median step time (ms)")
    times.invert_yaxis()
    tokens.barh(names, [row["tokens_per_s"] for row in rows], color="tab:green")
    tokens.set(xlabel="tokens/s")
    model = report["model"]
    figure.suptitle(f"TinyGPT d={model['dim']} L={model['layers']} T={model['seq']} B={model['batch']}, "
                    f"PJRT_DEVICE={report['device']}")
    for axes in (times, tokens):
        axes.grid(axis="x", alpha=0.3)
    figure.savefig(path, dpi=100)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deepspeed_xla.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps per system")
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from times and counters (compilation)")
    parser.add_argument("--dim", type=int, default=64, help="model width (even: TinyGPT has 2 heads)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--systems", nargs="+", type=parse_system, default=[parse_system(n) for n in DEFAULT_SYSTEMS],
                        metavar="SYSTEM",
                        help=f"floor or <xla|cpu>-zero<0-3>-<N>p (default: {' '.join(DEFAULT_SYSTEMS)})")
    parser.add_argument("--zero", nargs="+", type=zero_option, default=[], metavar="KEY=JSON",
                        help="extra zero_optimization settings of the DeepSpeed systems, "
                             "e.g. contiguous_gradients=true")
    parser.add_argument("--skip-bandwidth", action="store_true", help="skip the all-reduce bandwidth comparison")
    parser.add_argument("--bandwidth-mb", type=int, default=64)
    parser.add_argument("--bandwidth-iters", type=int, default=10)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--png", help="draw step times and tokens/s into this PNG (needs matplotlib)")
    parser.add_argument("--train-script", help="scripts/train.py of a deepspeed-xla checkout (default: found)")
    parser.add_argument("--workdir", help="where configs, per-rank JSON and logs go (default: a new temporary folder)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per system")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}: raise --steps")
    if args.dim % 2:
        parser.error(f"--dim {args.dim} does not split into TinyGPT's 2 attention heads: pass an even width")
    if args.bandwidth_iters < 1:
        parser.error("--bandwidth-iters must be at least 1")
    args.zero = dict(args.zero)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        WORKERS[args.worker](args)
        return 0
    train_script = find_train_script(args.train_script)
    from deepspeed_xla.devices import current_device_type
    device_type = current_device_type()  # writes PJRT_DEVICE for the children; never starts the runtime
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ds_xla_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    rows = [run_system(system, args, train_script, workdir, device_type.peak_bf16_flops()) for system in args.systems]
    add_floor_ratios(rows)
    report = {"command": " ".join(["python -m deepspeed_xla.bench", *(argv if argv is not None else sys.argv[1:])]),
              "model": {"dim": args.dim, "layers": args.layers, "seq": args.seq, "batch": args.batch,
                        "vocab": args.vocab, "matmul_params": matmul_params(args.dim, args.layers, args.vocab),
                        "flops_per_token": flops_per_token(args.dim, args.layers, args.vocab, args.seq)},
              "steps": args.steps, "warmup": args.warmup, "device": device_type.pjrt_name, "cpus": os.cpu_count(),
              "zero_options": args.zero, "systems": rows,
              "bandwidth": None if args.skip_bandwidth else run_bandwidth(args, workdir),
              "zero3_partition": zero3_partition(rows), "workdir": str(workdir)}
    report["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}
    report["targets"] = check_targets(report)
    print(render(report), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.png:
        plot(report, args.png)
    failed = any("error" in row for row in rows) or "error" in (report["bandwidth"] or {})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
