"""The counters and byte counts the benchmark and the tests read from the XLA runtime, on real PJRT CPU tensors."""
import torch

from deepspeed_xla import xla_runtime


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
