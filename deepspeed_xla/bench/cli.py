"""``python -m deepspeed_xla.bench``: the arguments and the driver's main loop."""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from deepspeed_xla.bench import driver, results, tpu_compile
from deepspeed_xla.bench.example import find_train_script
from deepspeed_xla.bench.roofline import TPUS
from deepspeed_xla.bench.systems import (DEFAULT_SYSTEMS, NAMING, feature_list, flops_per_token, matmul_params,
                                         parse_system, zero_option)
from deepspeed_xla.bench.workers import WORKERS
from deepspeed_xla.devices import current_device_type


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deepspeed_xla.bench",
                                     description="DeepSpeed on XLA against a hand-written torch_xla loop.")
    parser.add_argument("--steps", type=int, default=30, help="training steps per system")
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from times and counters (compilation)")
    parser.add_argument("--dim", type=int, default=64, help="model width (even: TinyGPT has 2 heads)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--grad-accum", type=int, default=1, metavar="N",
                        help="micro-batches per step (DeepSpeed's gradient_accumulation_steps)")
    parser.add_argument("--clip", type=float, default=0.0, metavar="NORM",
                        help="clip the gradients' global norm to this (DeepSpeed's gradient_clipping; 0: off)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the systems this many times in turn, keeping each one's median run: a ratio of two "
                             "systems then compares runs made under the same machine load")
    parser.add_argument("--systems", nargs="+", type=parse_system, default=[parse_system(n) for n in DEFAULT_SYSTEMS],
                        metavar="SYSTEM",
                        help=f"{NAMING}; hf-: through the Hugging Face Trainer. Features: {feature_list()} "
                             f"(default: {' '.join(DEFAULT_SYSTEMS)})")
    parser.add_argument("--zero", nargs="+", type=zero_option, default=[], metavar="KEY=JSON",
                        help="extra zero_optimization settings of the DeepSpeed systems, "
                             "e.g. contiguous_gradients=true")
    parser.add_argument("--skip-bandwidth", action="store_true", help="skip the all-reduce bandwidth comparison")
    parser.add_argument("--bandwidth-mb", type=int, default=64)
    parser.add_argument("--bandwidth-iters", type=int, default=10)
    parser.add_argument("--cost", action="store_true",
                        help="also count each system's step graph from its HLO (XLA's dump): FLOPs, element "
                             "operations, bytes, collectives, and a roofline estimate of the step on --tpu")
    parser.add_argument("--tpu", choices=sorted(TPUS), default="v5e", help="the TPU generation of --cost's estimate")
    parser.add_argument("--tpu-compile", type=tpu_compile.parse_chips, metavar="CHIPS",
                        help="instead of training: compile the step graph of the floor and ZeRO 0-3, fp32 and bf16, "
                             "at this model with libtpu for these TPU generations (e.g. v5e,v5p,v6e), without a TPU, "
                             "and report its memory, FLOPs, bytes, libtpu's time estimate and MFU per chip")
    parser.add_argument("--gpu-compile", type=tpu_compile.parse_gpus, metavar="GPUS",
                        help="as --tpu-compile (or besides it), with XLA's GPU compiler for these NVIDIA GPUs "
                             "(h100, a100), without a GPU: memory, FLOPs and bytes per GPU, no time estimate")
    parser.add_argument("--worlds", type=tpu_compile.parse_worlds, default=[4, 8], metavar="N,N",
                        help="with --tpu-compile or --gpu-compile: also each rank's step graph of ZeRO 0-3, fp32 and "
                             "bf16, at these world sizes, traced on as many PJRT CPU processes (default: 4,8; "
                             "none: '')")
    parser.add_argument("--trace-only", action="store_true",
                        help="with --tpu-compile or --gpu-compile: trace the step graphs without compiling them here "
                             "(a large model); they then carry no buffer donors, so nothing is aliased")
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
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.grad_accum < 1 or args.clip < 0:
        parser.error("--grad-accum must be at least 1 and --clip at least 0 (0 turns clipping off)")
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
    device_type = current_device_type()  # writes PJRT_DEVICE for the children; never starts the runtime
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ds_xla_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.tpu_compile or args.gpu_compile:
        return tpu_compile.run(args, train_script, workdir)
    load_start = os.getloadavg()[0]
    peak_flops = device_type.peak_bf16_flops()
    turns = [workdir] if args.repeats == 1 else [workdir / f"repeat{turn}" for turn in range(args.repeats)]
    for turn in turns:
        turn.mkdir(exist_ok=True)
    rounds = [[driver.run_system(system, args, train_script, turn, peak_flops) for system in args.systems]
              for turn in turns]
    rows = [results.median_run(list(runs)) for runs in zip(*rounds)]
    results.add_floor_ratios(rows)
    results.add_loop_ratios(rows, args.systems)
    report = {"command": " ".join(["python -m deepspeed_xla.bench", *(argv if argv is not None else sys.argv[1:])]),
              "model": {"dim": args.dim, "layers": args.layers, "seq": args.seq, "batch": args.batch,
                        "grad_accum": args.grad_accum, "clip": args.clip, "vocab": args.vocab,
                        "matmul_params": matmul_params(args.dim, args.layers, args.vocab),
                        "flops_per_token": flops_per_token(args.dim, args.layers, args.vocab, args.seq)},
              "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "device": device_type.pjrt_name,
              "cpus": os.cpu_count(),
              "zero_options": args.zero, "systems": rows,
              "bandwidth": None if args.skip_bandwidth else driver.run_bandwidth(args, workdir),
              "zero3_partition": results.zero3_partition(rows), "workdir": str(workdir)}
    report["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}
    report["targets"] = results.check_targets(report)
    print(results.render(report), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.png:
        results.plot(report, args.png)
    failed = any("error" in row for row in rows) or "error" in (report["bandwidth"] or {})
    return 1 if failed else 0
