"""``bench.tpu_compile``: the floor's and ZeRO 0-3's step graphs (fp32, bf16), a 2-stage pipeline's stage graphs and
each rank's ZeRO-3 step graph at world 4 with xla_ds's collectives (``bench.rank_graphs``), traced here by torch_xla, compiled by libtpu for v5e and v5p without a TPU (the compile-only venv of
scripts/setup_compile_env.sh); the figures are read from the compiler. A refusal here is one a TPU user would meet
first."""
import argparse
from pathlib import Path

import pytest

from deepspeed_xla.bench import rank_graphs, stage_graphs, tpu_compile
from deepspeed_xla.bench.roofline import TPUS
from deepspeed_xla.bench.step_graphs import parse_args as step_graph_args
from tests.conftest import REPO, STEP_GRAPH_DIM

pytestmark = pytest.mark.xdist_group("step_graphs")  # shares step_graph_cases with test_cost.py
CHIPS = ["v5e", "v5p"]
WORLD = 4
#: an all-reduce over 2 of the module's 4 replicas: what XLA refuses on a TPU (pytorch/xla#8271)
BROKEN_GROUPS = """module @broken attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 4 : i32} {
  func.func @main(%arg0: tensor<1024xf32>) -> tensor<1024xf32> {
    %0 = "stablehlo.all_reduce"(%arg0) ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) {replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>} : (tensor<1024xf32>) -> tensor<1024xf32>
    return %0 : tensor<1024xf32>
  }
}
"""


@pytest.fixture(scope="module")
def compiled(step_graph_cases, tmp_path_factory):
    """Every executed case's step graph and every stage graph of a 2-stage fp32 pipeline of the same model, for every
    chip; the floor's fp32 one again without its buffer donors; and a module of bad replica groups: one compile-only
    process."""
    tmp = tmp_path_factory.mktemp("tpu_compile")
    model = step_graph_args(["--dim", str(STEP_GRAPH_DIM)])
    args = argparse.Namespace(batch=model.batch, clip=1.0, dim=model.dim, layers=2, seq=model.seq, vocab=model.vocab,
                              seed=model.seed, timeout=600)
    stages = stage_graphs.trace_stages(args, REPO / "scripts" / "train.py", tmp, "fp32")
    ranks = [case for case in rank_graphs.trace_ranks(step_graph_args([
        "--dim", str(STEP_GRAPH_DIM), "--layers", "2", "--systems", "zero3", "--dtypes", "bf16"]),
        WORLD, tmp) if case["rank"] in (0, WORLD - 1)]  # the first and the last partition
    cases = step_graph_cases["executed"] + stages + ranks
    floor = Path(next(case["stablehlo"] for case in cases if case["name"] == "floor-fp32-2"))
    (tmp / "undonated.mlir").write_text(floor.read_text().replace(" {jax.buffer_donor = true}", ""))
    (tmp / "broken.mlir").write_text(BROKEN_GROUPS)
    graphs = [tpu_compile.Graph(case["name"], case["stablehlo"], case.get("world", 1)) for case in cases] + [
        tpu_compile.Graph("floor-fp32-undonated", str(tmp / "undonated.mlir")),
        tpu_compile.Graph("broken-groups", str(tmp / "broken.mlir"), replicas=4)]
    results = tpu_compile.compile_graphs(graphs, CHIPS, tpu_compile.compile_python(REPO), tmp)
    return {"cases": {case["name"]: case for case in cases}, "results": results, "stages": stages, "ranks": ranks,
            "by": {(result["graph"], result["chip"]): result for result in results}}


def test_every_step_and_stage_graph_compiles_for_v5e_and_v5p(compiled):
    """And only the module of bad replica groups is refused, on each chip, its error naming it, the chip and why."""
    assert {(r["graph"], r["chip"]) for r in compiled["results"]} == {
        (graph, chip) for graph in [*compiled["cases"], "floor-fp32-undonated", "broken-groups"] for chip in CHIPS}
    refused = tpu_compile.refusals(compiled["results"])
    assert [line.split(":")[0] for line in refused] == ["broken-groups on v5e", "broken-groups on v5p"]
    assert all("replica groups should contain 4 replicas" in line for line in refused), refused


def test_the_compiler_counts_the_graphs_matmul_work(compiled):
    """XLA's FLOPs of the optimised graph hold at least the dots counted in torch_xla's HLO (bench.cost), and bytes
    are accessed; a chip's memory holds the code and the arguments."""
    for name, case in compiled["cases"].items():
        for chip in CHIPS if "dot_flops" in case else ():
            result = compiled["by"][name, chip]
            assert result["cost"]["flops"] >= case["dot_flops"] > 0, (name, chip)
            assert result["cost"]["bytes accessed"] > 0 and result["memory"]["generated_code_size_in_bytes"] > 0


def test_arguments_are_the_traced_state_per_chip(compiled, train_module):
    """A chip holds the graph's parameters as torch_xla traced them (``bytes_read`` of its HLO), tiled: never fewer
    bytes, at most twice (TPU tiles pad this small width). The floor's parameters are its state: fp32 weights and
    AdamW's two moments (bf16: the bf16 weights besides), and the batch."""
    model = train_module.TinyGPT(64, 64, 2, seq=64)  # step_graphs' defaults at STEP_GRAPH_DIM
    weights = sum(p.numel() for p in model.parameters())
    batch = 2 * 8 * 64 * 8  # tokens and targets, int64
    for dtype, state in (("fp32", 12 * weights), ("bf16", 14 * weights)):
        case = compiled["cases"][f"floor-{dtype}-2"]
        assert state + batch <= case["bytes_read"] <= state + batch + 1024, dtype  # and a few scalars
    for name, case in compiled["cases"].items():
        for chip in CHIPS if "bytes_read" in case else ():
            arguments = compiled["by"][name, chip]["memory"]["argument_size_in_bytes"]
            assert case["bytes_read"] <= arguments <= 2 * case["bytes_read"], (name, chip)


def test_buffer_donors_alias_the_state_updated_in_place(compiled, train_module):
    """With the donors of torch_xla's compile, the floor's weights and moments are aliased to the outputs that
    update them, as in a run; the same module without them aliases nothing. ZeRO-1/2 update every argument but the
    batch in place: no second copy of the state on a chip (``patches/zero_params.py``: the parameters own their
    buffers; upstream's flat copy of the weights was an argument never donated)."""
    weights = sum(p.numel() for p in train_module.TinyGPT(64, 64, 2, seq=64).parameters())
    for chip in CHIPS:
        donated = compiled["by"]["floor-fp32-2", chip]["memory"]
        undonated = compiled["by"]["floor-fp32-undonated", chip]["memory"]
        assert donated["alias_size_in_bytes"] >= 12 * weights and undonated["alias_size_in_bytes"] == 0, chip
        assert donated["argument_size_in_bytes"] == undonated["argument_size_in_bytes"]
        for name in (f"{system}-{dtype}-2" for system in ("zero1", "zero2") for dtype in ("fp32", "bf16")):
            memory = compiled["by"][name, chip]["memory"]
            assert memory["alias_size_in_bytes"] >= memory["argument_size_in_bytes"] - 64 * 1024, (name, chip, memory)
    for name, case in compiled["cases"].items():
        if "stage" not in case and "rank" not in case:  # a step graph compiled here: with its donors
            assert case["donors"] > 0 and compiled["by"][name, "v5e"]["memory"]["alias_size_in_bytes"] > 0, name


def test_each_stage_runs_a_graph_per_micro_batch(compiled):
    """A stage's step is several graphs, between which the activations or gradients pass on the host: of the steady
    step, each stage runs one graph once per micro-batch, and the two stages' graphs hold the model's matmuls."""
    stages = compiled["stages"]
    assert {case["stage"] for case in stages} == {0, 1}
    for stage in (0, 1):
        runs = [case["runs"] for case in stages if case["stage"] == stage]
        assert stage_graphs.MICRO_BATCHES in runs and len(runs) > 1, (stage, runs)
    floor_flops = compiled["by"]["floor-fp32-2", "v5e"]["cost"]["flops"]
    flops = sum(compiled["by"][case["name"], "v5e"]["cost"]["flops"] * case["runs"] for case in stages)
    assert flops >= floor_flops  # the floor's step trains one micro-batch, the pipeline's four


def test_a_steady_step_is_the_last_run_of_graphs_the_step_before_repeats():
    hashes = ["init", "a", "x", "x", "y", "b", "x", "x", "y", "c", "x", "x", "y", "c", "read"]
    assert stage_graphs.steady_step(hashes) == (10, 14)  # past the final read; not the first step's "b"
    with pytest.raises(ValueError, match="at least 3 steps"):
        stage_graphs.steady_step(["init", "a", "b", "read"])


def test_rows_and_table(compiled):
    """A row per case and chip: the MFU that libtpu's estimate implies, a refusal as such."""
    cases = list(compiled["cases"].values())
    cases.append({"name": "broken-groups", "system": "broken", "dtype": "fp32", "layers": 0})
    results = [r for r in compiled["results"] if r["graph"] != "floor-fp32-undonated"]
    rows = tpu_compile.report_rows(cases, results, model_flops=1e9)
    for row in rows:
        if "error" not in row:
            peak = TPUS[row["chip"]].peak_bf16_flops
            assert row["mfu"] == (1e9 / (row["seconds"] * peak) if row["seconds"] else None)
    table = tpu_compile.render(rows).splitlines()
    assert len(table) == 2 + len(results)
    assert [line.split()[:2] for line in table if "refused:" in line] == [["broken", "fp32"]] * len(CHIPS)


def test_negative_estimates_are_unmodelled_instructions():
    """libtpu's −1 s per instruction without a cost model, then the rest: 16 of them and 377.66 µs."""
    got = tpu_compile.estimate({"cost": {"optimal_seconds": -15.99962234}})
    assert got["unmodelled"] == 16 and got["seconds"] == pytest.approx(377.66e-6)
    assert tpu_compile.estimate({"cost": {"optimal_seconds": 2e-3}}) == {"seconds": 2e-3, "unmodelled": 0}


def test_chips_and_their_refusal():
    assert tpu_compile.parse_chips("v5e, v6e") == ["v5e", "v6e"]
    with pytest.raises(argparse.ArgumentTypeError, match="v4.*--tpu-compile v5e,v5p"):
        tpu_compile.parse_chips("v4,v5e")


def test_ranks_of_a_zero3_world_compile_for_their_chips_holding_a_quarter_of_the_state(compiled):
    """The first and the last rank's ZeRO-3 bf16 step at world 4, traced on 4 PJRT CPU processes with xla_ds's
    collectives in the graph (parameters all-gathered, gradients reduce-scattered, the norm all-reduced), compile
    for 4 chips of v5e and v5p; a chip's arguments (its partitions of the weights, fp32 masters and moments) are
    under half the one-process step's, which holds all of them."""
    assert [case["rank"] for case in compiled["ranks"]] == [0, WORLD - 1]
    for case in compiled["ranks"]:
        module = Path(case["stablehlo"]).read_text()
        assert all(f"stablehlo.{op}" in module for op in ("all_gather", "reduce_scatter", "all_reduce")), case["name"]
        for chip in CHIPS:
            result, whole = compiled["by"][case["name"], chip], compiled["by"]["zero3-bf16-2", chip]
            assert "error" not in result, (case["name"], chip, result.get("error"))
            assert result["cost"]["flops"] > 0
            assert result["memory"]["argument_size_in_bytes"] < whole["memory"]["argument_size_in_bytes"] / 2
