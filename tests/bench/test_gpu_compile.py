"""``bench.tpu_compile`` for NVIDIA GPUs: the floor's and ZeRO 0-3's step graphs (fp32, bf16), traced here by
torch_xla, compiled by XLA's GPU compiler for an H100 without a GPU (deviceless, in the compile-only venv of
scripts/setup_compile_env.sh, beside libtpu); the figures are read from the compiler. Each rank's graph at world 8
is not compiled: those graphs are not traced yet (docs/performance.md)."""
import argparse

import pytest

from deepspeed_xla.bench import tpu_compile
from tests.conftest import REPO

pytestmark = pytest.mark.xdist_group("step_graphs")  # shares step_graph_cases with test_tpu_compile.py
GPUS = ["h100"]


@pytest.fixture(scope="module")
def gpu_compiled(step_graph_cases, tmp_path_factory):
    """Every executed case's step graph (with torch_xla's buffer donors) for every GPU: one compile-only process."""
    tmp = tmp_path_factory.mktemp("gpu_compile")
    cases = step_graph_cases["executed"]
    graphs = [tpu_compile.Graph(case["name"], case["stablehlo"]) for case in cases]
    results = tpu_compile.compile_graphs(graphs, GPUS, tpu_compile.compile_python(REPO), tmp)
    return {"cases": {case["name"]: case for case in cases}, "results": results,
            "by": {(result["graph"], result["chip"]): result for result in results}}


def test_every_floor_and_zero_step_graph_compiles_for_h100(gpu_compiled):
    """fp32 and bf16, the floor and ZeRO 0-3: none refused."""
    cases = gpu_compiled["cases"].values()
    assert {(case["system"], case["dtype"]) for case in cases} == {
        (system, dtype) for system in ("floor", "zero0", "zero1", "zero2", "zero3") for dtype in ("fp32", "bf16")}
    assert {(r["graph"], r["chip"]) for r in gpu_compiled["results"]} == {
        (name, gpu) for name in gpu_compiled["cases"] for gpu in GPUS}
    assert tpu_compile.refusals(gpu_compiled["results"]) == []


def test_the_gpu_compiler_counts_the_graphs_matmul_work_and_state(gpu_compiled, train_module):
    """XLA's cost analysis of the GPU-optimised graph holds at least the traced dots, and bytes move; a GPU holds the
    traced parameters untiled (the arguments are ``bytes_read`` of torch_xla's HLO, no more), and the donors alias the
    floor's weights and AdamW's moments to their updates as on a TPU."""
    weights = sum(p.numel() for p in train_module.TinyGPT(64, 64, 2, seq=64).parameters())
    for name, case in gpu_compiled["cases"].items():
        for gpu in GPUS:
            result = gpu_compiled["by"][name, gpu]
            assert result["cost"]["flops"] >= case["dot_flops"] > 0, (name, gpu)
            assert result["cost"]["bytes accessed"] > 0 and "optimal_seconds" not in result["cost"], (name, gpu)
            assert result["memory"]["argument_size_in_bytes"] == case["bytes_read"], (name, gpu)
            assert result["memory"]["alias_size_in_bytes"] > 0, (name, gpu)
    for gpu in GPUS:
        assert gpu_compiled["by"]["floor-fp32-2", gpu]["memory"]["alias_size_in_bytes"] >= 12 * weights


def test_gpu_rows_have_no_estimate(gpu_compiled):
    """No time estimate for a GPU, so no MFU: the table says '-' where a TPU's row has them."""
    rows = tpu_compile.report_rows(list(gpu_compiled["cases"].values()), gpu_compiled["results"], model_flops=1e9)
    assert all(row["seconds"] is None and row["mfu"] is None for row in rows)
    table = tpu_compile.render(rows).splitlines()
    assert len(table) == 2 + len(rows) and all(line.split()[-3:] == ["-", "-", "-"] for line in table[2:])


def test_gpus_and_their_refusal():
    assert tpu_compile.parse_gpus("h100, a100") == ["h100", "a100"]
    with pytest.raises(argparse.ArgumentTypeError, match="v5e.*--gpu-compile h100,a100"):
        tpu_compile.parse_gpus("v5e,h100")
