"""Each rank's step graph at world N with ``xla_ds``'s in-graph collectives, traced on PJRT CPU for the TPU compiler.

A pod runs every rank's step as one XLA graph whose collectives are XLA's (``xla_ds``), but PJRT CPU processes
connect to no other device, so those graphs cannot run here. ``N`` ranks are started by the ``deepspeed`` CLI on
``xla_ds`` anyway: the steps before the last go through host memory (``xla_collectives.host_routed``), and the last
is traced with XLA's collectives and stopped before it compiles (``xla_runtime.unexecuted``). Each rank's graph, saved
as StableHLO, is what ``bench.tpu_compile`` compiles for ``N`` chips:

    python -m deepspeed_xla.bench.rank_graphs --world 4 --systems zero3 --dtypes bf16 --workdir /tmp/ranks
"""
import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from deepspeed_xla.bench import driver, step_graphs
from deepspeed_xla.bench.cost import saved_graphs
from deepspeed_xla.bench.saved_stablehlo import module_text

COLLECTIVES = ("stablehlo.all_reduce", "stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.all_to_all")


def worker(args: argparse.Namespace) -> None:
    """One rank: warm up over gloo, trace the last step with XLA's collectives, write it as StableHLO."""
    import deepspeed
    import torch
    from deepspeed_xla import xla_runtime
    from deepspeed_xla.bench.example import find_train_script, load_example
    from deepspeed_xla.comm import backends, xla_collectives
    backends.register_backend(xla_collectives.BACKEND_NAME, host_addressable=True)
    deepspeed.init_distributed(dist_backend=xla_collectives.BACKEND_NAME)
    rank = deepspeed.comm.get_rank()
    train = load_example(str(find_train_script(args.train_script)))
    torch.manual_seed(args.seed)
    xla_runtime.set_eager(args.no_compile)  # --trace-only: the steps before the last run op by op, as step_graphs'
    with xla_collectives.host_routed():
        model = train.TinyGPT(args.vocab, args.dim, args.layers[0], seq=args.seq).to(xla_runtime.device())
        step = step_graphs.deepspeed_step(train, model, args, args.dtypes[0], int(args.system[-1]))
        for index in range(args.steps - 1):
            step(index)
            xla_runtime.sync(wait=True)
    xla_runtime.set_eager(False)
    with xla_runtime.as_world_of(deepspeed.comm.get_world_size()), xla_runtime.unexecuted():  # saved, not compiled
        step(args.steps - 1)
        xla_runtime.sync(wait=True)
    module = module_text(saved_graphs(Path(f"{_saved_prefix(args.graphs, rank)}.0").read_text())[-1])
    if not any(op in module for op in COLLECTIVES):
        raise SystemExit(f"rank {rank}: the traced step holds no XLA collective: it did not run on xla_ds")
    Path(args.graphs).with_name(f"{Path(args.graphs).name}-rank{rank}.mlir").write_text(module)
    with xla_collectives.host_routed():
        deepspeed.comm.barrier()  # rank 0 holds the store: the others are done with it
    sys.stdout.flush()
    os._exit(0)  # the untraced step's tensors have no values: no exit hook may read them


def _saved_prefix(graphs: str, rank: int) -> str:
    """Where rank ``rank`` saves its graphs (``XLA_SAVE_TENSORS_FILE``); torch_xla appends the device's ordinal, 0 in
    every process here."""
    return f"{graphs}.rank{rank}"


def trace_ranks(args: argparse.Namespace, world: int, workdir: Path) -> List[dict]:
    """Every rank's step graph at ``world`` for each system and dtype of ``args``: one ``deepspeed`` run each."""
    cases = []
    for system in args.systems:
        for dtype in args.dtypes:
            name = f"{system}-{dtype}-w{world}"
            graphs = workdir / name
            cmd = driver.deepspeed_command(world, [
                "--no_local_rank", __file__, "--worker", "--system", system, "--graphs", str(graphs),
                *step_graphs.shared_flags(args, dtypes=[dtype], layers=args.layers[:1])])
            env = dict(driver.child_env("xla", world), CPU_NUM_DEVICES=str(world),
                       XLA_SAVE_TENSORS_FMT="stablehlo")
            error = driver.run(cmd, env, workdir / f"{name}.log", args.timeout)
            if error:
                raise SystemExit(f"tracing {name}'s ranks failed: {error}")
            cases += [dict(system=system, dtype=dtype, layers=args.layers[0], world=world, rank=rank, donors=None,
                           name=f"{name}-rank{rank}", stablehlo=str(workdir / f"{name}-rank{rank}.mlir"))
                      for rank in range(world)]
    return cases


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = step_graphs.argument_parser("python -m deepspeed_xla.bench.rank_graphs", __doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4, help="ranks, one PJRT CPU process each")
    args = step_graphs.checked(parser, argv)
    if args.worker:
        os.environ["XLA_SAVE_TENSORS_FILE"] = _saved_prefix(args.graphs, int(os.environ["RANK"]))
        worker(args)
        return 0
    workdir = Path(args.workdir or step_graphs.temporary_workdir())
    workdir.mkdir(parents=True, exist_ok=True)
    for case in trace_ranks(args, args.world, workdir):
        print(case["stablehlo"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
