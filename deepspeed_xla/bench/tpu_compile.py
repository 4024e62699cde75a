"""``python -m deepspeed_xla.bench --tpu-compile v5e,v5p,v6e --gpu-compile h100,a100``: what the TPU compiler and
XLA's GPU compiler say of the step graphs.

torch_xla traces each case's step graph here (``bench.step_graphs --stablehlo``: the floor and ZeRO 0–3, fp32 and
bf16, one process) and each stage's graphs of a 2-stage pipeline (``bench.stage_graphs``), and writes them as
StableHLO; libtpu, in a compile-only venv of its own (``requirements-compile.txt``, built on demand by
``scripts/setup_compile_env.sh``), compiles them for a named chip without one (``bench/tpu_compiler.py``, run as a
subprocess: libtpu and torch_xla cannot share a process). Reported per graph and chip: the compile time, the HBM a
chip needs (arguments, outputs, aliased, temporaries, code), the FLOPs and bytes of XLA's cost analysis, libtpu's
time estimate and the MFU it implies. XLA's GPU compiler, in the same venv and process, compiles them for an H100 or
A100 without one (``GPU_TARGETS``): memory and XLA's cost analysis of the optimised HLO, no time estimate. A step graph
carries the buffer donors torch_xla's own compile gives XLA
(parameters and optimizer state updated in place), read from the XLA dump of the same graph compiled here, so its
aliased bytes are those of a real run (none with ``--trace-only``, nor for the stages' graphs).
"""
import argparse
import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional

from deepspeed_xla.bench import rank_graphs, stage_graphs, step_graphs
from deepspeed_xla.bench.roofline import TPUS
from deepspeed_xla.bench.systems import flops_per_token

COMPILER = Path(__file__).with_name("tpu_compiler.py")
#: the GPUs XLA's GPU compiler targets without one: their GpuTargetConfigProto, as in openxla/xla's
#: xla/backends/gpu/target_config/specs/
GPU_TARGETS = {"h100": Path(__file__).with_name("gpu_targets") / "h100_sxm.txtpb",
               "a100": Path(__file__).with_name("gpu_targets") / "a100_sxm_80.txtpb"}


@dataclass
class Graph:
    """One StableHLO module to compile: ``name`` says which case it is, ``replicas`` the chips it runs on."""
    name: str
    path: str
    replicas: int = 1


def compile_python(repo: Path) -> str:
    """The compile-only venv's python: ``DSX_COMPILE_PYTHON``, else built (or found) by the checkout's
    ``scripts/setup_compile_env.sh``."""
    if os.environ.get("DSX_COMPILE_PYTHON"):
        return os.environ["DSX_COMPILE_PYTHON"]
    script = repo / "scripts" / "setup_compile_env.sh"
    proc = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"{script} could not build the compile-only venv (exit code {proc.returncode}): see its "
                         "output above, or point DSX_COMPILE_PYTHON at a python with jax[tpu] installed")
    return proc.stdout.strip().splitlines()[-1]


def compile_graphs(graphs: List[Graph], chips: List[str], python: str, workdir: Path,
                   timeout: float = 3600) -> List[dict]:
    """Every graph compiled for every chip (a TPU generation, or a GPU of ``GPU_TARGETS``) in ``python`` (one
    subprocess): a result per graph and chip, in that order, the figures or the compiler's ``error``."""
    job, out = workdir / "tpu_compile_job.json", workdir / "tpu_compile_out.json"
    gpus = {chip: str(GPU_TARGETS[chip]) for chip in chips if chip in GPU_TARGETS}
    job.write_text(json.dumps({"chips": chips, "gpu_targets": gpus, "graphs": [asdict(graph) for graph in graphs]}))
    env = {key: value for key, value in os.environ.items()  # this venv's paths and PJRT CPU's flags are not libtpu's
           if key not in ("PYTHONPATH", "XLA_FLAGS", "PJRT_DEVICE") and not key.startswith("TPU_")}
    with open(workdir / "tpu_compile.log", "w") as log:
        code = subprocess.run([python, str(COMPILER), str(job), str(out)], env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout).returncode
    if code:
        raise SystemExit(f"the TPU compiler's process failed (exit code {code}): see {workdir / 'tpu_compile.log'}")
    return json.loads(out.read_text())


def refusals(results: List[dict]) -> List[str]:
    """One line per graph and chip the compiler refused, naming both."""
    return [f"{r['graph']} on {r['chip']}: {r['error'].splitlines()[0]}" for r in results if "error" in r]


def estimate(result: dict) -> dict:
    """libtpu's time estimate, which comes back negative when instructions have no cost model: −1 s for each of
    them plus the estimate of the rest. The modelled seconds, and how many instructions it leaves out."""
    seconds = result["cost"].get("optimal_seconds")
    if seconds is None:
        return {"seconds": None, "unmodelled": None}
    unmodelled = max(0, -int(seconds // 1)) if seconds < 0 else 0
    return {"seconds": seconds + unmodelled, "unmodelled": unmodelled}


def report_rows(cases: List[dict], results: List[dict], model_flops: Optional[float]) -> List[dict]:
    """A row per case and chip: the case, the compiler's figures, and the MFU that libtpu's estimate implies for
    ``model_flops`` (the analytic FLOPs of the step's tokens; None: a graph that is part of a step) at the chip's
    bf16 peak (a GPU has no estimate)."""
    by_name = {case["name"]: case for case in cases}
    rows = []
    for result in results:
        row = dict(by_name[result["graph"]], **result)
        if "error" not in result:
            row.update(estimate(result))
            seconds = row["seconds"]
            peak = TPUS[row["chip"]].peak_bf16_flops if seconds else None
            row["mfu"] = model_flops / (seconds * peak) if seconds and model_flops else None
        rows.append(row)
    return rows


def render(rows: List[dict]) -> str:
    """The table: MB per chip, GFLOP and GB of XLA's cost analysis, libtpu's estimate in µs ('-': a GPU's)."""
    header = (f"{'case':20} {'chip':4} {'compile s':>9} {'args MB':>9} {'out MB':>8} {'alias MB':>8} {'temp MB':>8} "
              f"{'code MB':>7} {'GFLOP':>9} {'GB moved':>8} {'est. us':>9} {'unmod.':>6} {'MFU':>6}")
    lines = [header, "-" * len(header)]
    for row in rows:
        case = f"{row['system']} {row['dtype']}" + (f" w{row['world']}r{row['rank']}" if "world" in row else "")
        if "error" in row:
            lines.append(f"{case:20} {row['chip']:4} refused: {row['error'].splitlines()[0][:100]}")
            continue
        memory, cost = row["memory"], row["cost"]
        mb = [memory[key] / 2 ** 20 for key in ("argument_size_in_bytes", "output_size_in_bytes",
                                                 "alias_size_in_bytes", "temp_size_in_bytes",
                                                 "generated_code_size_in_bytes")]
        mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
        estimate_us = "-" if row["seconds"] is None else f"{row['seconds'] * 1e6:.1f}"
        unmodelled = "-" if row["unmodelled"] is None else str(row["unmodelled"])
        lines.append(f"{case:20} {row['chip']:4} {row['compile_s']:9.1f} {mb[0]:9.2f} {mb[1]:8.2f} {mb[2]:8.2f} "
                     f"{mb[3]:8.2f} {mb[4]:7.2f} {cost['flops'] / 1e9:9.3f} {cost['bytes accessed'] / 1e9:8.3f} "
                     f"{estimate_us:>9} {unmodelled:>6} {mfu:>6}")
    return "\n".join(lines)


def _parse(text: str, known: dict, what: str, example: str) -> List[str]:
    chips = [chip.strip() for chip in text.split(",") if chip.strip()]
    unknown = [chip for chip in chips if chip not in known]
    if unknown or not chips:
        raise argparse.ArgumentTypeError(f"unknown {what} {','.join(unknown) or text!r}: name some of "
                                          f"{','.join(sorted(known))}, e.g. {example}")
    return chips


def parse_chips(text: str) -> List[str]:
    """``--tpu-compile``'s comma-separated TPU generations."""
    return _parse(text, TPUS, "TPU generation", "--tpu-compile v5e,v5p")


def parse_gpus(text: str) -> List[str]:
    """``--gpu-compile``'s comma-separated GPUs."""
    return _parse(text, GPU_TARGETS, "GPU", "--gpu-compile h100,a100")


def parse_worlds(text: str) -> List[int]:
    """``--worlds``' comma-separated world sizes (none: '')."""
    worlds = [part.strip() for part in text.split(",") if part.strip()]
    if not all(world.isdigit() and int(world) > 1 for world in worlds):
        raise argparse.ArgumentTypeError(f"world sizes are numbers above 1, e.g. --worlds 4,8 (got {text!r})")
    return [int(world) for world in worlds]


def run(args: argparse.Namespace, train_script: Path, workdir: Path) -> int:
    """Trace the floor and ZeRO 0–3 in fp32 and bf16 at the bench's model, the stages of a 2-stage pipeline of it and
    each rank's step graph of ZeRO 0-3 at ``args.worlds``; compile each for every chip of ``args.tpu_compile`` and
    ``args.gpu_compile``, print the tables (and write them as JSON to ``args.out``); 1 if a graph was refused."""
    chips = (args.tpu_compile or []) + (args.gpu_compile or [])
    flags = ["--stablehlo", "--layers", str(args.layers), "--dim", str(args.dim), "--seq", str(args.seq), "--batch",
             str(args.batch), "--vocab", str(args.vocab), "--clip", str(args.clip), "--seed", str(args.seed),
             "--train-script", str(train_script)] + ["--no-compile"] * args.trace_only
    steps = step_graphs.count_systems(step_graphs.parse_args(flags), workdir)
    stages = [case for dtype in step_graphs.DTYPES for case in stage_graphs.trace_stages(args, train_script, workdir,
                                                                                         dtype)]
    ranks = [case for world in args.worlds for case in
             rank_graphs.trace_ranks(step_graphs.parse_args(flags + ["--systems", *step_graphs.SYSTEMS[1:]]), world,
                                     workdir)]
    graphs = [Graph(case["name"], case["stablehlo"], case.get("world", 1)) for case in steps + stages + ranks]
    results = compile_graphs(graphs, chips, compile_python(train_script.parents[1]), workdir)
    model_flops = flops_per_token(args.dim, args.layers, args.vocab, args.seq) * args.batch * args.seq
    ends = [len(steps) * len(chips), (len(steps) + len(stages)) * len(chips)]
    tables = {"steps": report_rows(steps, results[:ends[0]], model_flops),
              "stages": report_rows(stages, results[ends[0]:ends[1]], None),
              "ranks": report_rows(ranks, results[ends[1]:], model_flops)}
    print(f"TinyGPT dim {args.dim}, {args.layers} layers, seq {args.seq}, batch {args.batch}, vocab {args.vocab}; "
          f"compile-only clients (libtpu, XLA's GPU compiler), figures per chip\n\nStep graphs, one process:\n"
          f"{render(tables['steps'])}\n\n"
          f"Pipeline stages (2 processes, {stage_graphs.MICRO_BATCHES} micro-batches; gNxK: graph N, run K times "
          f"a step):\n{render(tables['stages'])}\n\n"
          f"Each rank's step graph at world {', '.join(map(str, args.worlds))} (xla_ds's collectives in the graph; "
          f"the batch per rank; MFU of one rank's tokens on its chip):\n{render(tables['ranks'])}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": {"dim": args.dim, "layers": args.layers, "seq": args.seq,
                                                       "batch": args.batch, "vocab": args.vocab}, **tables}, indent=1))
    return 1 if refusals(results) else 0
