"""``patches/zero3_reduce.py``: ZeRO-3's gradient reduce-scatter executes what is pending only where the collective
cuts the graph anyway (tests/launched/test_zero3_options.py runs it on 2 processes)."""
import pytest
import torch

from deepspeed_xla import patches, xla_runtime
from deepspeed_xla.patches import zero3_reduce


@pytest.mark.parametrize("device, backend, world, syncs", [("xla", "xla_host", 2, 1), ("xla", "xla_host", 1, 0),
                                                           ("xla", "xla_ds", 2, 0), ("cpu", "xla_host", 2, 0)])
def test_syncs_before_a_host_staged_reduce_scatter_of_several_ranks(monkeypatch, device, backend, world, syncs):
    """Only an XLA reduce-scatter on a host-staged group of several ranks executes every pending tensor first; on
    TPU's in-graph collectives or a one-rank group a sync would cut the step's graph for nothing. The collective
    gets its arguments unchanged."""
    import deepspeed.runtime.comm.coalesced_collectives  # noqa: F401 (the patch applies as it loads)
    import torch.distributed as torch_dist
    (patch,) = [p for p in patches.PATCHES if p.wrapper is zero3_reduce.reduce_scatter_computes_pending]
    assert patches.is_applied(patch)
    events = []
    monkeypatch.setattr(torch_dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch_dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(xla_runtime, "sync_live", lambda: events.append("sync"))
    wrapped = zero3_reduce.reduce_scatter_computes_pending(lambda *args, **kwargs: events.append((args, kwargs)))
    xla_runtime.torch_xla()  # the XLA device type exists once torch_xla is imported
    place = xla_runtime.device() if device == "xla" else torch.device("cpu")
    tensor, output, group = torch.zeros(4, device=place), torch.zeros(2, device=place), object()
    wrapped(tensor, output, group, async_op=False)
    assert events == ["sync"] * syncs + [((tensor, output, group), {"async_op": False})]
