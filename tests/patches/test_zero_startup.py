"""``patches/zero_startup.py``: ZeRO-3's move of its partitions into one flat buffer, in one execution."""
import torch

from deepspeed_xla import patches, xla_runtime
from deepspeed_xla.patches import zero_startup


def test_defragment_builds_upstreams_buffer_in_one_execution(xla_device):
    """Pending partitions of different shapes (each a graph of its own upstream) become the buffer upstream builds
    from the same values on the CPU, each tensor a span of it, with one compilation and one execution."""
    import deepspeed.runtime.zero.stage3 as stage3
    from deepspeed.runtime.zero import utils
    (patch,) = [p for p in patches.PATCHES if p.wrapper is zero_startup.defragment_at_once]
    assert patches.is_applied(patch) and stage3.defragment.__wrapped__ is utils.defragment
    sources = [torch.randn(n) for n in (5, 7, 11)]
    expected_tensors = [source * 2 for source in sources]
    expected = utils.defragment(expected_tensors)
    tensors = [source.to(xla_device) * 2 for source in sources]  # pending: not executed yet
    before = xla_runtime.graph_counters()
    buffer = stage3.defragment(tensors)
    after = xla_runtime.graph_counters()
    assert {key: after[key] - before[key] for key in ("compilations", "executions")} == {"compilations": 1,
                                                                                         "executions": 1}
    assert torch.equal(buffer.cpu(), expected)
    buffer.add_(1)  # each tensor is a view of its span, as upstream's are
    for tensor, source in zip(tensors, sources):
        assert torch.equal(tensor.cpu(), source * 2 + 1)
