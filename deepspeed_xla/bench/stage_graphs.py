"""Each pipeline stage's graphs of one step, for ``--tpu-compile``: a 2-stage DeepSpeed pipeline of the bench's model
(``scripts/train.py --pipeline-stages 2`` under the ``deepspeed`` CLI, PJRT CPU) saves every graph each rank executes
as StableHLO (``--save-graphs``), and a steady step's graphs are the run of graphs that the last steps repeat.

The stages pass activations and gradients between processes on the host (docs/pipeline.md: on a TPU host too), so
a stage's step is several graphs: each micro-batch's forward and backward, and the optimizer's step. They carry no
buffer donors (the ranks share one XLA dump's names), so their aliased bytes are none.
"""
import argparse
import json
import re
from pathlib import Path
from typing import List, Tuple

from deepspeed_xla.bench import driver
from deepspeed_xla.bench.cost import saved_graphs
from deepspeed_xla.bench.saved_stablehlo import module_text
from deepspeed_xla.bench.systems import ds_config

STAGES = 2
MICRO_BATCHES = 4  # the pipeline's gradient accumulation: scripts/configs/pipe2.json's


def steady_step(hashes: List[str]) -> Tuple[int, int]:
    """The [start, end) of the last step whose graphs the step before repeats, past graphs after the last step (the
    losses' final read)."""
    for trailing in range(len(hashes)):
        end = len(hashes) - trailing
        for size in range(1, end // 2 + 1):
            if hashes[end - size:end] == hashes[end - 2 * size:end - size]:
                return end - size, end
    raise ValueError("no step's graphs repeat the step's before: train at least 3 steps")


def stage_cases(saved: str, rank: int, dtype: str, workdir: Path) -> List[dict]:
    """A stage's distinct graphs of a steady step, each written as ``pipe-<dtype>-stage<rank>-<i>.mlir``, with how
    many times the step runs it."""
    graphs = saved_graphs(saved)
    hashes = [re.search(r"Graph Hash: (\w+)", graph)[1] for graph in graphs]
    start, end = steady_step(hashes)
    cases = []
    for index, digest in enumerate(dict.fromkeys(hashes[start:end])):
        name = f"pipe-{dtype}-stage{rank}-{index}"
        path = workdir / f"{name}.mlir"
        path.write_text(module_text(graphs[hashes.index(digest, start)]))
        cases.append({"name": name, "system": f"pipe s{rank} g{index}x{hashes[start:end].count(digest)}",
                      "dtype": dtype, "stage": rank, "runs": hashes[start:end].count(digest), "donors": None,
                      "stablehlo": str(path)})
    return cases


def trace_stages(args: argparse.Namespace, train_script: Path, workdir: Path, dtype: str) -> List[dict]:
    """Train the bench's model as a 2-stage pipeline for 3 steps in ``dtype``; every stage's graphs of its last."""
    config = ds_config(0, args.batch, accum=MICRO_BATCHES, clip=args.clip)
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    (workdir / f"pipe-{dtype}.json").write_text(json.dumps(config))
    prefix = workdir / f"pipe-{dtype}.graphs"
    cmd = driver.deepspeed_command(STAGES, [
        str(train_script), "--deepspeed_config", str(workdir / f"pipe-{dtype}.json"), "--pipeline-stages",
        str(STAGES), "--steps", "3", "--timings", "--dim", str(args.dim), "--layers", str(max(args.layers, STAGES)),
        "--seq", str(args.seq), "--vocab", str(args.vocab), "--seed", str(args.seed), "--save-graphs", str(prefix)])
    error = driver.run(cmd, driver.child_env("xla", STAGES), workdir / f"pipe-{dtype}.log", args.timeout)
    if error:
        raise SystemExit(f"the {STAGES}-stage pipeline ({dtype}) failed: {error}")
    return [case for rank in range(STAGES) for case in
            stage_cases(Path(f"{prefix}.rank{rank}.0").read_text(), rank, dtype, workdir)]
