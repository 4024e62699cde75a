"""``patches/nvtx.py``: DeepSpeed's NVTX wrappers do no work for ranges the XLA accelerator does not record."""
from deepspeed_xla import patches
from deepspeed_xla.patches import nvtx as nvtx_patch


def test_a_method_deepspeed_instruments_asks_nothing_of_torch_or_the_accelerator(monkeypatch):
    """Each call of an ``instrument_w_nvtx`` method (ZeRO-3's fetch and release, ~4,000 a step at 16 layers) asked
    ``is_compiling`` and the accelerator twice, for ranges ``XLA_Accelerator.range_push`` drops."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import nvtx
    accelerator = get_accelerator()
    assert accelerator._name == "xla"
    (patch,) = [p for p in patches.PATCHES if p.wrapper is nvtx_patch.ranges_off]
    assert patches.is_applied(patch) and nvtx.enable_nvtx is False
    asked = []
    monkeypatch.setattr(nvtx, "is_compiling", lambda: asked.append("is_compiling") or False)
    monkeypatch.setattr(nvtx, "get_accelerator", lambda: asked.append("accelerator") or accelerator)
    fetch = nvtx.instrument_w_nvtx(lambda module: module * 2)
    assert [fetch(3) for _ in range(5)] == [6] * 5
    assert asked == []
    monkeypatch.setattr(nvtx, "enable_nvtx", True)  # upstream's switch: asked on every call
    assert fetch(3) == 6
    assert asked == ["is_compiling", "accelerator", "is_compiling", "accelerator"]
    assert accelerator.range_push("fetch_sub_module") is None
