"""The step graphs of the floor and of DeepSpeed's ZeRO stages, counted in fp32 and bf16 at several depths.

``python -m deepspeed_xla.bench.step_graphs`` runs one process per system; each trains TinyGPT a few steps for every
(dtype, depth), each in a forked child, and counts that case's step graph with ``bench.cost``: the counts are
deterministic, so the targets of docs/performance.md ('Cost of a step') can be asserted on them
(tests/bench/test_cost.py). ``--no-compile`` counts the same graphs without compiling them, which is what deep models
cost: ``python -m deepspeed_xla.bench.step_graphs --layers 2 16 --no-compile``.
The floor is the bench's hand-written torch_xla loop (``torch.optim.AdamW``), training as DeepSpeed does: the
gradients clipped to ``--clip`` (DeepSpeed's default ``gradient_clipping``, 1.0), and in bf16 fp32 master weights:
bf16 weights and gradients, the clipping and the optimizer on fp32 copies, the weights copied back. DeepSpeed runs
the bench's config (``systems.ds_config``) with the same clipping.
"""
import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from deepspeed_xla.bench.cost import saved_graphs, step_cost, step_graph, step_module
from deepspeed_xla.bench.example import find_train_script, load_example
from deepspeed_xla.bench.saved_stablehlo import donors, mark_donors, step_stablehlo
from deepspeed_xla.bench.systems import LR, WEIGHT_DECAY, ds_config, zero_option

SYSTEMS = ("floor", "zero0", "zero1", "zero2", "zero3")
DTYPES = ("fp32", "bf16")


def _floor_step(train, model, args: argparse.Namespace, dtype: str) -> Callable[[int], None]:
    """The bench's floor loop, one step; in bf16 with fp32 master weights (one cast of the gradients, one copy
    back)."""
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

    def step(index: int) -> None:
        tokens, targets = train.make_batch(index, 0, args.batch, args.seq, args.vocab)
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

    return step


def deepspeed_step(train, model, args: argparse.Namespace, dtype: str, stage: int) -> Callable[[int], None]:
    import deepspeed
    config = ds_config(stage, args.batch, args.zero, clip=args.clip)
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(index: int) -> None:
        tokens, targets = train.make_batch(index, 0, args.batch, args.seq, args.vocab)
        engine.backward(engine(tokens.to(engine.device), targets.to(engine.device)))
        engine.step()

    return step


def _saved_file(path: Path) -> Optional[Path]:
    """torch_xla appends the device's ordinal to ``XLA_SAVE_TENSORS_FILE``; None before it saved a graph."""
    return next(path.parent.glob(path.name + "*"), None)


def _count_case(args: argparse.Namespace, train, dtype: str, layers: int) -> dict:
    """Train a fresh TinyGPT of ``layers`` in ``dtype`` with this process's system, and count its last step's graph.

    With ``--no-compile`` the steps before the last run op by op (torch_xla's eager mode), and the last is traced and
    stopped at its sync, before its graph is compiled or run.
    """
    import torch
    from deepspeed_xla import xla_runtime
    saved = _saved_file(Path(args.graphs))
    before = saved.stat().st_size if saved else 0  # earlier cases' graphs, not read
    shutil.rmtree(_dump_folder(args), ignore_errors=True)  # earlier cases' compilations
    torch.manual_seed(args.seed)
    xla_runtime.set_eager(args.no_compile)  # DeepSpeed's start-up too: one lazy graph of it compiles longer
    model = train.TinyGPT(args.vocab, args.dim, layers, seq=args.seq).to(xla_runtime.device())
    if args.system == "floor":
        step = _floor_step(train, model, args, dtype)
    else:
        step = deepspeed_step(train, model, args, dtype, int(args.system[-1]))
    for index in range(args.steps - 1):
        step(index)
        xla_runtime.sync(wait=True)
    xla_runtime.set_eager(False)
    with xla_runtime.unexecuted() if args.no_compile else contextlib.nullcontext():
        step(args.steps - 1)
        xla_runtime.sync(wait=True)
    with open(_saved_file(Path(args.graphs)), "rb") as graphs:
        graphs.seek(before)
        text = graphs.read().decode()  # this case's graphs
    if args.stablehlo:
        return _stablehlo_case(args, text, dtype, layers)
    return dict(step_cost(step_graph(saved_graphs(text))), system=args.system, dtype=dtype, layers=layers)


def _dump_folder(args: argparse.Namespace) -> Path:
    """Where ``--stablehlo`` has XLA dump the graphs it compiles (``count_systems``)."""
    return Path(args.graphs).with_suffix(".dump")


def _stablehlo_case(args: argparse.Namespace, saved: str, dtype: str, layers: int) -> dict:
    """The case's step graph as StableHLO, written beside the saved graphs, with the buffer donors of torch_xla's
    compile of it and its counts, both from that compile's HLO (XLA's dump); traced only, neither."""
    name = f"{args.system}-{dtype}-{layers}"
    module, row = step_stablehlo(saved), dict(system=args.system, dtype=dtype, layers=layers, name=name, donors=None)
    if not args.no_compile:
        hlo = step_module(_dump_folder(args)).read_text()
        module = mark_donors(module, hlo)
        row.update(step_cost(hlo), donors=len(donors(hlo)))
    path = Path(args.graphs).parent / f"{name}.mlir"
    path.write_text(module)
    return dict(row, stablehlo=str(path))


def _forked(run: Callable[..., dict], *args) -> dict:
    """``run(*args)`` in a forked child, its result passed back as JSON.

    No case may inherit another's state: ZeRO-3 keeps every model it trained alive to the end of the process (and
    its linear function in place of torch's), and ``--no-compile`` leaves the tensors of the step it did not run
    without values, which the next sync would read. Forking after the imports spares each case their seconds.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            with os.fdopen(write, "w") as pipe:
                json.dump(run(*args), pipe)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # no exit hooks: they would sync those tensors
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code:
        raise SystemExit(f"a case failed in its child process (exit code {code}): see the traceback above")
    return json.loads(text)


def worker(args: argparse.Namespace) -> None:
    """This process's system at every (dtype, depth), each case in a child of its own: their counts into
    ``args.out`` (JSON)."""
    import deepspeed  # noqa: F401  (imported once, before the children)
    from deepspeed_xla import xla_runtime
    xla_runtime.torch_xla()
    train = load_example(str(find_train_script(args.train_script)))
    results = [_forked(_count_case, args, train, dtype, layers) for dtype in args.dtypes for layers in args.layers]
    Path(args.out).write_text(json.dumps(results))


def count_systems(args: argparse.Namespace, workdir: Path) -> List[dict]:
    """Run one worker process per system of ``args.systems``, in turn; their cases. Each saves the HLO of every graph
    it executes (``XLA_SAVE_TENSORS_FILE``): a cached graph is saved too, which an XLA dump (compilations) misses.
    With ``--stablehlo`` it saves StableHLO, and XLA dumps what it compiles (the buffer donors of ``_stablehlo_case``).
    """
    rows = []
    for system in args.systems:
        graphs, out = workdir / f"{system}.graphs", workdir / f"{system}.json"
        env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"), DS_ACCELERATOR="xla",
                   XLA_SAVE_TENSORS_FILE=str(graphs), XLA_SAVE_TENSORS_FMT="stablehlo" if args.stablehlo else "hlo")
        if args.stablehlo:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={graphs.with_suffix('.dump')} " \
                               "--xla_dump_hlo_as_text".strip()
        cmd = [sys.executable, "-m", "deepspeed_xla.bench.step_graphs", "--worker", "--system", system,
               "--graphs", str(graphs), "--out", str(out), *shared_flags(args)]
        with open(workdir / f"{system}.log", "w") as log:
            code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        if code:
            raise SystemExit(f"{system} failed (exit code {code}): see {workdir / f'{system}.log'}")
        rows += json.loads(out.read_text())
    return rows


def shared_flags(args: argparse.Namespace, dtypes: Optional[List[str]] = None,
                 layers: Optional[List[int]] = None) -> List[str]:
    """``args``' model and training flags, for a worker process (``dtypes`` and ``layers`` in place of its own)."""
    flags = ["--dtypes", *(dtypes or args.dtypes), "--layers", *map(str, layers or args.layers), "--dim",
             str(args.dim), "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab), "--steps",
             str(args.steps), "--seed", str(args.seed), "--clip", str(args.clip)] \
        + ["--no-compile"] * args.no_compile + ["--stablehlo"] * args.stablehlo
    if args.train_script:
        flags += ["--train-script", args.train_script]
    return flags + (["--zero", *(f"{k}={json.dumps(v)}" for k, v in args.zero.items())] if args.zero else [])


def ratios(rows: List[dict], key: str) -> Dict[tuple, float]:
    """``key`` of every case over the floor's at the same dtype and depth."""
    floor = {(r["dtype"], r["layers"]): r[key] for r in rows if r["system"] == "floor"}
    return {(r["system"], r["dtype"], r["layers"]): r[key] / floor[r["dtype"], r["layers"]] for r in rows
            if (r["dtype"], r["layers"]) in floor}


def argument_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The model, training and worker flags (``bench.rank_graphs`` adds its own)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 16])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="the first creates the optimizer's state; later ones "
                                                               "run the step graph")
    parser.add_argument("--no-compile", action="store_true",
                        help="count the last step's graph without compiling or running it: the steps before it run "
                             "op by op (torch_xla's eager mode). The same graph, without a deep model's "
                             "compilations")
    parser.add_argument("--stablehlo", action="store_true",
                        help="write each case's step graph as StableHLO (NAME.mlir in --workdir) with the buffer "
                             "donors of its compilation here, for another compiler (bench.tpu_compile)")
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
    return parser


def checked(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    args = parser.parse_args(argv)
    args.zero = dict(args.zero)
    if args.clip < 0:
        parser.error("--clip must be at least 0 (0 turns clipping off)")
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step's graph also creates the optimizer's state")
    return args


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    return checked(argument_parser("python -m deepspeed_xla.bench.step_graphs", __doc__.split("\n")[0]), argv)


def temporary_workdir() -> str:
    return tempfile.mkdtemp(prefix="ds_xla_step_graphs_")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    workdir = Path(args.workdir or temporary_workdir())
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
