"""``patches/grad_checks.py``: DeepSpeed's overflow test and clipping on the device."""
import inspect

import pytest
import torch


def test_has_inf_or_nan_reduces_on_xla():
    import torch_xla
    from deepspeed.runtime.utils import has_inf_or_nan
    device = torch_xla.device()
    finite = torch.randn(4, 5).to(device)
    with_inf = finite.clone()
    with_inf[1, 2] = float("inf")
    with_nan = finite.clone()
    with_nan[3, 0] = float("nan")
    assert [bool(has_inf_or_nan(t).cpu()) for t in (finite, with_inf, with_nan)] == [False, True, True]
    assert has_inf_or_nan(with_inf).shape == torch.Size([])


@pytest.mark.parametrize("max_norm", [100.0, 0.5], ids=["unclipped", "clipped"])
def test_clip_by_global_norm_stays_on_device_and_matches_upstream(max_norm):
    import torch_xla
    from deepspeed.runtime import bf16_optimizer, utils
    from deepspeed_xla.xla_runtime import graph_counters
    upstream = inspect.unwrap(utils.clip_tensors_by_global_norm)
    grads = [torch.randn(5, 3), torch.randn(7)]
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    expected = [g.clone() for g in grads]
    upstream(expected, max_norm=max_norm, global_norm=norm)
    device = torch_xla.device()
    on_xla = [g.to(device) for g in grads]
    torch_xla.sync()
    before = graph_counters()
    bf16_optimizer.clip_tensors_by_global_norm(on_xla, max_norm=max_norm, global_norm=norm.to(device))
    assert graph_counters() == before, "clipping read a device value on the host"
    for got, want in zip(on_xla, expected):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-6)
