"""The step graphs of the floor and of DeepSpeed's ZeRO stages, counted in fp32 and bf16 at several depths.

``python -m deepspeed_xla.bench.step_graphs`` runs one process per system; each trains TinyGPT a few steps for every
(dtype, depth) in turn and counts that case's step graph with ``bench.cost``: the counts are deterministic, so the
targets of docs/performance.md ('Cost of a step') can be asserted on them (tests/bench/test_cost.py).
The floor is the bench's hand-written torch_xla loop (``torch.optim.AdamW``), training as DeepSpeed does: the
gradients clipped to ``--clip`` (DeepSpeed's default ``gradient_clipping``, 1.0), and in bf16 fp32 master weights:
bf16 weights and gradients, the clipping and the optimizer on fp32 copies, the weights copied back. DeepSpeed runs
the bench's config (``systems.ds_config``) with the same clipping.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from deepspeed_xla.bench.cost import saved_graphs, step_cost, step_graph
from deepspeed_xla.bench.example import find_train_script, load_example
from deepspeed_xla.bench.systems import LR, WEIGHT_DECAY, ds_config, zero_option

SYSTEMS = ("floor", "zero0", "zero1", "zero2", "zero3")
DTYPES = ("fp32", "bf16")


def _floor_steps(train, model, args: argparse.Namespace, dtype: str) -> None:
    """The bench's floor loop; in bf16 with fp32 master weights (one cast of the gradients, one copy back)."""
    import torch
    from deepspeed_xla import xla_runtime
    device = xla_runtime.device()
    params = list(model.parameters())
    if dtype == "bf16":
        model.to(torch.bfloat16)
        masters = [p.detach().float() for p in params]
    else:
        masters = params
    optimizer = torch.optim.AdamW(masters, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    for step in range(args.steps):
        tokens, targets = train.make_batch(step, 0, args.batch, args.seq, args.vocab)
        model(tokens.to(device), targets.to(device)).backward()
        if dtype == "bf16":
            for master, param in zip(masters, params):
                master.grad = param.grad.float()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(masters, args.clip)
        optimizer.step()
        if dtype == "bf16":
            torch._foreach_copy_([p.data for p in params], masters)
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        xla_runtime.sync(wait=True)


def _deepspeed_steps(train, model, args: argparse.Namespace, dtype: str, stage: int) -> None:
    import deepspeed
    from deepspeed_xla import xla_runtime
    config = ds_config(stage, args.batch, args.zero, clip=args.clip)
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(args.steps):
        tokens, targets = train.make_batch(step, 0, args.batch, args.seq, args.vocab)
        engine.backward(engine(tokens.to(engine.device), targets.to(engine.device)))
        engine.step()
        xla_runtime.sync(wait=True)
    engine.destroy()


def _saved_file(path: Path) -> Path:
    """torch_xla appends the device's ordinal to ``XLA_SAVE_TENSORS_FILE``."""
    return next(path.parent.glob(path.name + "*"))


def worker(args: argparse.Namespace) -> None:
    """This process's system at every (dtype, depth): each case's counts into ``args.out`` (JSON)."""
    import torch
    from deepspeed_xla import xla_runtime
    xla_runtime.torch_xla()
    train = load_example(str(find_train_script(args.train_script)))
    saved = Path(args.graphs)
    results, read = [], 0
    for dtype in args.dtypes:
        for layers in args.layers:
            torch.manual_seed(args.seed)
            model = train.TinyGPT(args.vocab, args.dim, layers, seq=args.seq).to(xla_runtime.device())
            if args.system == "floor":
                _floor_steps(train, model, args, dtype)
            else:
                _deepspeed_steps(train, model, args, dtype, int(args.system[-1]))
            text = _saved_file(saved).read_text()
            graph = step_graph(saved_graphs(text[read:]))  # this case's graphs
            read = len(text)
            results.append(dict(step_cost(graph), system=args.system, dtype=dtype, layers=layers))
    Path(args.out).write_text(json.dumps(results))


def count_systems(args: argparse.Namespace, workdir: Path) -> List[dict]:
    """Run one worker process per system of ``args.systems``, in turn; their cases. Each saves the HLO of every graph
    it executes (``XLA_SAVE_TENSORS_FILE``): a cached graph is saved too, which an XLA dump (compilations) misses."""
    rows = []
    for system in args.systems:
        graphs, out = workdir / f"{system}.graphs", workdir / f"{system}.json"
        env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"), DS_ACCELERATOR="xla",
                   XLA_SAVE_TENSORS_FILE=str(graphs), XLA_SAVE_TENSORS_FMT="hlo")
        cmd = [sys.executable, "-m", "deepspeed_xla.bench.step_graphs", "--worker", "--system", system,
               "--graphs", str(graphs), "--out", str(out), *_shared_flags(args)]
        with open(workdir / f"{system}.log", "w") as log:
            code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        if code:
            raise SystemExit(f"{system} failed (exit code {code}): see {workdir / f'{system}.log'}")
        rows += json.loads(out.read_text())
    return rows


def _shared_flags(args: argparse.Namespace) -> List[str]:
    flags = ["--dtypes", *args.dtypes, "--layers", *map(str, args.layers), "--dim", str(args.dim), "--seq",
             str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab), "--steps", str(args.steps),
             "--seed", str(args.seed), "--clip", str(args.clip)]
    if args.train_script:
        flags += ["--train-script", args.train_script]
    return flags + (["--zero", *(f"{k}={json.dumps(v)}" for k, v in args.zero.items())] if args.zero else [])


def ratios(rows: List[dict], key: str) -> Dict[tuple, float]:
    """``key`` of every case over the floor's at the same dtype and depth."""
    floor = {(r["dtype"], r["layers"]): r[key] for r in rows if r["system"] == "floor"}
    return {(r["system"], r["dtype"], r["layers"]): r[key] / floor[r["dtype"], r["layers"]] for r in rows
            if (r["dtype"], r["layers"]) in floor}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deepspeed_xla.bench.step_graphs",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 16])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="the first creates the optimizer's state; later ones "
                                                               "run the step graph")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--clip", type=float, default=1.0, metavar="NORM",
                        help="clip the gradients' global norm to this, the floor as DeepSpeed (0: off)")
    parser.add_argument("--zero", nargs="+", type=zero_option, default=[], metavar="KEY=JSON",
                        help="extra zero_optimization settings, e.g. reduce_bucket_size=5000")
    parser.add_argument("--train-script", help="scripts/train.py of a deepspeed-xla checkout (default: found)")
    parser.add_argument("--workdir", help="where the saved graphs, logs and JSON go (default: a new temporary folder)")
    parser.add_argument("--out", help="write the cases' counts as JSON here")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per system")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--graphs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.zero = dict(args.zero)
    if args.clip < 0:
        parser.error("--clip must be at least 0 (0 turns clipping off)")
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step's graph also creates the optimizer's state")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ds_xla_step_graphs_"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = count_systems(args, workdir)
    elementwise = ratios(rows, "elementwise_ops")
    print(f"{'system':8} {'dtype':5} {'layers':>6} {'dot GFLOP':>10} {'elementwise M':>14} {'x floor':>8} "
          f"{'moved M':>8}")
    for row in rows:
        ratio = elementwise.get((row["system"], row["dtype"], row["layers"]))  # none without the floor's case
        print(f"{row['system']:8} {row['dtype']:5} {row['layers']:6d} {row['dot_flops'] / 1e9:10.4f} "
              f"{row['elementwise_ops'] / 1e6:14.3f} {'-' if ratio is None else f'{ratio:.3f}':>8} "
              f"{row['movement_elements'] / 1e6:8.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
