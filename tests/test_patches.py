"""Every run-time patch of DeepSpeed still matches the upstream code it was written for."""
import importlib
from importlib import metadata

import pytest
import torch

from deepspeed_xla import bootstrap, patches


def test_written_for_the_installed_deepspeed():
    assert metadata.version("deepspeed") == patches.WRITTEN_FOR


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: f"{p.module}.{p.owner}.{p.attr}")
def test_patched_upstream_source_unchanged(patch):
    importlib.import_module(patch.module)
    assert patches.is_applied(patch), "patch not applied under DS_ACCELERATOR=xla"
    assert patches.upstream_digest(patch) == patch.digest, (
        f"DeepSpeed changed {patch.module}.{patch.owner}.{patch.attr}: re-check the patch in deepspeed_xla/patches.py")


def test_startup_hook_covers_every_patched_module():
    hooked = {name for name, hook in bootstrap._AFTER_IMPORT.items() if hook == bootstrap._PATCHES_HOOK}
    assert hooked == set(patches.PATCHED_MODULES)


def test_keep_parameter_objects_preserves_identity():
    import torch_xla
    model = torch.nn.Linear(3, 2)
    before = list(model.parameters())
    with patches.keep_parameter_objects():
        model.to(torch_xla.device())
    assert all(a is b for a, b in zip(before, model.parameters()))
    assert model.weight.device.type == "xla"


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
