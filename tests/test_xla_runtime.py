"""The counters and byte counts the benchmark and the tests read from the XLA runtime, and a graph stopped before it
is compiled, on real PJRT CPU tensors."""
import sys

import torch

from deepspeed_xla import xla_runtime
from tests.conftest import REPO, clean_env
from tests.multiproc import run_command


def test_graph_counters_include_an_execution_still_running():
    """torch_xla counts an execution when it completes; the counters must not miss one that sync queued."""
    xla_runtime.torch_xla()
    x = torch.randn(1200, 1200, device=xla_runtime.device())
    xla_runtime.sync()
    before = xla_runtime.graph_counters()
    for _ in range(3):
        x = (x @ x).tanh()
    xla_runtime.sync(wait=False)
    after = xla_runtime.graph_counters()
    assert after["executions"] == before["executions"] + 1, (before, after)
    xla_runtime.sync()
    assert xla_runtime.graph_counters()["executions"] == after["executions"], "an empty sync executed a graph"


def test_live_device_bytes_counts_each_buffer_once():
    xla_runtime.torch_xla()
    before = xla_runtime.live_device_bytes()
    base = torch.zeros(1000, device=xla_runtime.device())
    pending = torch.ones(500, dtype=torch.bfloat16, device=xla_runtime.device())
    assert xla_runtime.live_device_bytes() == before, "a tensor that was never executed holds no buffer"
    xla_runtime.sync()
    alias = base.detach()
    assert xla_runtime.live_device_bytes() - before == 1000 * 4 + 500 * 2  # the alias shares base's buffer
    del base, alias, pending
    assert xla_runtime.live_device_bytes() == before


def test_sync_live_executes_every_pending_tensor_in_one_graph():
    """What ZeRO-3's reduce-scatter runs first on PJRT CPU (patches/zero3_reduce.py): the tensors no one asked for
    (here ``loss``) are executed with the ones a collective needs, in one graph, and the step goes on (the RNG seed
    is not moved on, as a step marker would)."""
    xla_runtime.torch_xla()
    x = torch.randn(64, 64, device=xla_runtime.device())
    xla_runtime.sync()
    seed = xla_runtime.get_seed()
    loss, grad = (x @ x).sum(), x.tanh()
    assert xla_runtime.pending([loss, grad]) == [True, True]
    before = xla_runtime.graph_counters()
    xla_runtime.sync_live()
    after = xla_runtime.graph_counters()
    assert xla_runtime.pending([loss, grad]) == [False, False]
    assert after["executions"] == before["executions"] + 1, (before, after)
    assert xla_runtime.get_seed() == seed


STOPPED_BEFORE_COMPILING = """
import torch
from deepspeed_xla import xla_runtime
xla_runtime.torch_xla()
x = torch.randn(8, 8, device=xla_runtime.device())
xla_runtime.sync()
before = xla_runtime.graph_counters()
reached = False
with xla_runtime.unexecuted():
    y = (x @ x).sum()
    xla_runtime.sync()
    reached = True
after = xla_runtime.graph_counters()
print("reached", reached, "compiled", after["compilations"] - before["compilations"],
      "executed", after["executions"] - before["executions"])
try:
    with xla_runtime.unexecuted():
        raise RuntimeError("not torch_xla's")
except RuntimeError as error:
    print("raised", error)
"""


def test_unexecuted_stops_at_the_sync_after_saving_the_graph(tmp_path):
    """``bench.step_graphs --no-compile``: the block ends at its sync, whose graph torch_xla saves but neither
    compiles nor runs; an error of the block's own goes on. In a child process: the graph's tensors are left without
    values."""
    saved = tmp_path / "graphs"
    proc = run_command([sys.executable, "-c", STOPPED_BEFORE_COMPILING], 300, cwd=REPO,
                       env=clean_env(XLA_SAVE_TENSORS_FILE=str(saved), XLA_SAVE_TENSORS_FMT="hlo"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reached False compiled 0 executed 0" in proc.stdout and "raised not torch_xla's" in proc.stdout
    (graphs,) = tmp_path.glob("graphs*")
    assert graphs.read_text().split("## BEGIN_GRAPH")[-1].count(" dot(") == 1  # the stopped graph was saved
