"""Every run-time patch of DeepSpeed still matches the upstream code it was written for."""
import importlib
import inspect
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
        f"DeepSpeed changed {patch.module}.{patch.owner}.{patch.attr}: re-check the patch in deepspeed_xla/patches/")


def test_startup_hook_covers_every_patched_module():
    hooked = {name for name, hook in bootstrap._AFTER_IMPORT.items() if hook == bootstrap._PATCHES_HOOK}
    assert hooked == set(patches.PATCHED_MODULES)


def test_keep_parameter_objects_preserves_identity():
    import torch_xla
    model = torch.nn.Linear(3, 2)
    before = list(model.parameters())
    with patches.engine.keep_parameter_objects():
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


def _configure_zero(zero_config: dict, module=None, has_moe_layers=False):
    """Run the ``_configure_zero_optimizer`` patch on an engine stand-in; returns DeepSpeed's parsed ZeRO config."""
    from types import SimpleNamespace
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    zero = DeepSpeedZeroConfig(**zero_config)
    engine = SimpleNamespace(module=module or torch.nn.Linear(8, 1), has_moe_layers=has_moe_layers,
                             _config=SimpleNamespace(zero_config=zero))
    patches.engine.configure_zero_optimizer(lambda self, optimizer: None)(engine, None)
    return zero


def test_capped_bucket_sizes_stay_even():
    """ZeRO-1/2 assert an even all-gather bucket: a model with an odd parameter count (9) gets 10, not 9."""
    zero = _configure_zero({"stage": 2})
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == zero.prefetch_bucket_size == 10


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_contiguous_gradients_off_unless_the_config_sets_it(stage):
    assert _configure_zero({"stage": stage}).contiguous_gradients is False
    assert _configure_zero({"stage": stage, "contiguous_gradients": True}).contiguous_gradients is True
    assert _configure_zero({"stage": stage}, has_moe_layers=True).contiguous_gradients is True  # ZeRO-2 MoE needs it


def count_device_waits():
    """Run by ``run_ranks``: device waits during steady-state steps of a default and a ``synchronized`` config."""
    import json
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    waits = []
    synchronize = accelerator.synchronize
    accelerator.synchronize = lambda *args, **kwargs: (waits.append(1), synchronize(*args, **kwargs))[1]
    counts = {}
    for name, timers in (("default", {}), ("synchronized", {"throughput": {"synchronized": True}})):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                  "zero_optimization": {"stage": 2}, "timers": timers}
        engine, *_ = deepspeed.initialize(model=model, config=config)
        x = torch.randn(4, 8).to(engine.device)
        for step in range(6):
            if step == 3:  # DeepSpeed's throughput timer starts timing at step 2
                waits.clear()
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
        counts[name] = len(waits)
    print(json.dumps(counts))


def test_steps_wait_for_the_device_only_when_the_config_asks():
    """DeepSpeed's throughput timer waits for the device twice a step by default; on XLA that stops the host
    from tracing step N+1 while the device runs step N. ``timers.throughput.synchronized`` set: as asked."""
    import json
    from tests.multiproc import run_ranks
    [proc] = run_ranks("tests.test_patches:count_device_waits", 1, env={"DS_ACCELERATOR": "xla"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts == {"default": 0, "synchronized": 2 * 3}


@pytest.mark.parametrize("args", ["input, weight, bias", "input, weight"])
def test_zero3_linear_matches_f_linear(xla_device, args):
    """ZeRO-3's memory-efficient linear with every argument given (the positional shortcut) and without the
    bias (torch's binding fills it in), against ``F.linear`` on CPU, forward and backward."""
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3
    torch.manual_seed(0)
    cpu = {"input": torch.randn(2, 3, 5), "weight": torch.randn(4, 5), "bias": torch.randn(4)}
    names = args.split(", ")
    results = []
    for tensors, linear in ((cpu, torch.nn.functional.linear), ({k: v.to(xla_device) for k, v in cpu.items()},
                                                               LinearFunctionForZeroStage3.apply)):
        leaves = [tensors[name].clone().requires_grad_() for name in names]
        out = linear(*leaves)
        out.pow(2).sum().backward()
        results.append([t.detach().cpu() for t in (out, *(leaf.grad for leaf in leaves))])
    for expected, actual in zip(*results):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def zero3_step_against_upstream():
    """Run by ``run_ranks``: ZeRO-3's patched step functions next to upstream's on the same state, and the
    ``inspect.signature`` calls of steady-state steps."""
    import json
    import deepspeed
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
    found = {"gradients": [], "norms": [], "spans": 0, "signatures": 0}

    def prepare(self, sub_group_id):
        grads = list(self.averaged_gradients[sub_group_id])
        upstream_prepare(self, sub_group_id)
        upstream = self.fp32_partitioned_groups_flat[sub_group_id].grad.cpu()
        self.averaged_gradients[sub_group_id] = grads
        found["spans"] += patches.zero._grad_buffer_span(self, sub_group_id) is not None
        patched_prepare(self, sub_group_id)
        found["gradients"].append((upstream.tolist(), self.fp32_partitioned_groups_flat[sub_group_id].grad.tolist()))

    def grad_norm(self, gradients, params, norm_type=2):
        patched = patched_norm(self, gradients, params, norm_type)
        found["norms"].append((float(upstream_norm(self, gradients, params, norm_type)), float(patched)))
        return patched

    def signature(*args, **kwargs):
        found["signatures"] += 1
        return upstream_signature(*args, **kwargs)

    patched_prepare, patched_norm = Stage3._prepare_fp32_grad_for_sub_group, Stage3.get_grad_norm_direct
    upstream_prepare, upstream_norm = inspect.unwrap(patched_prepare), inspect.unwrap(patched_norm)
    Stage3._prepare_fp32_grad_for_sub_group, Stage3.get_grad_norm_direct = prepare, grad_norm
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 64}}
    engine, optimizer, *_ = deepspeed.initialize(model=model, config=config)
    x = torch.randn(4, 7).to(engine.device)
    upstream_signature = inspect.signature
    for step in range(5):
        if step == 3:
            inspect.signature = signature
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    inspect.signature = upstream_signature
    found["sub_groups"] = len(optimizer.fp16_groups)
    print(json.dumps(found))


def test_zero3_step_shortcuts_match_upstream():
    """ZeRO-3's optimizer reads each gradient partition (a view of the flat gradient buffer) for its input
    and for the norm, and wraps every module's inputs and outputs in autograd Functions that torch binds
    to their signature on each call: host work per parameter and per module, every step. The patches
    give the same gradients and norm (2 ranks: partitions with padding; several sub-groups) and bind
    no signature in steady state. The ranks end right after ``engine.step()``, which deadlocked at exit
    before ``xla_runtime._drain_before_exit``."""
    import json
    from tests.multiproc import run_ranks
    for proc in run_ranks("tests.test_patches:zero3_step_against_upstream", 2, env={"DS_ACCELERATOR": "xla"}):
        assert proc.returncode == 0, proc.stderr[-6000:]
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        assert found["sub_groups"] >= 2
        assert found["spans"] == len(found["gradients"]) == 5 * found["sub_groups"]
        assert all(upstream == patched for upstream, patched in found["gradients"])
        assert len(found["norms"]) == 5 * found["sub_groups"]
        assert all(upstream == patched for upstream, patched in found["norms"])
        assert found["signatures"] == 0
