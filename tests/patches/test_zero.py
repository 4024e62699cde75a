"""``patches/zero.py``: ZeRO-3's step shortcuts and ZeRO-1/2 offload's batched reads give upstream's values with
less host work."""
import inspect
import math

import pytest
import torch

from deepspeed_xla import patches


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
        found["spans"] += patches.zero3_grads._grad_buffer_span(self, sub_group_id) is not None
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
    """ZeRO-3's optimizer reads each gradient partition (a view of the flat gradient buffer) for its input and for
    the norm, and wraps every module's inputs and outputs in autograd Functions that torch binds to their signature
    on each call: host work per parameter and per module, every step. The patches give the same gradients and, up to
    rounding, the same norm (2 ranks: partitions with padding; several sub-groups) and bind no signature in steady
    state. The ranks end right after ``engine.step()``, which deadlocked at exit before
    ``xla_runtime._drain_before_exit``."""
    import json
    from tests.multiproc import run_ranks
    for proc in run_ranks("tests.patches.test_zero:zero3_step_against_upstream", 2, env={"DS_ACCELERATOR": "xla"}):
        assert proc.returncode == 0, proc.stderr[-6000:]
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        assert found["sub_groups"] >= 2
        assert found["spans"] == len(found["gradients"]) == 5 * found["sub_groups"]
        assert all(upstream == patched for upstream, patched in found["gradients"])
        assert len(found["norms"]) == 5 * found["sub_groups"]
        assert all(upstream > 0 and math.isclose(upstream, patched, rel_tol=1e-6)
                   for upstream, patched in found["norms"]), found["norms"]  # a sum of squares: rounding apart
        assert found["signatures"] == 0


class _ConvX(torch.nn.Conv1d):
    """DeepSpeed's ``unit/runtime/zero/test_zero_context.py`` model: a parameter added after ``super().__init__()``,
    made with a legacy constructor that ``zero.Init``'s tensor-creation wrappers do not catch (a host tensor)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.param_in = torch.nn.Parameter(torch.FloatTensor(5).uniform_())


class _ConvNet(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.conv1 = _ConvX(1, 3, 4)
        self.param = torch.nn.Parameter(torch.FloatTensor(5).uniform_())


def zero_init_subclass_param():
    """Run by ``run_ranks``: DeepSpeed's ``TestSerialContext::test_subclass_param`` (its config: ZeRO-3, bf16),
    printing each parameter's status, where its partition is held and its gathered values."""
    import json
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    config = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config=config):
        model = _ConvNet()
    params = dict(model.named_parameters())
    statuses = {name: p.ds_status == ZeroParamStatus.NOT_AVAILABLE for name, p in params.items()}
    held = {name: p.ds_tensor.device.type for name, p in params.items()}
    with deepspeed.zero.GatheredParameters(list(params.values())):
        gathered = {name: p.detach().float().cpu().tolist() for name, p in params.items()}
    print(json.dumps({"partitioned": statuses, "held_on": held, "gathered": gathered,
                      "same_objects": (model.param is params["param"]
                                       and model.conv1.param_in is params["conv1.param_in"])}))


@pytest.mark.parametrize("accelerator", ["xla", "cpu"])
def test_zero_init_partitions_a_parameter_made_on_the_host(accelerator):
    """DeepSpeed's own ``test_subclass_param``, on XLA and on DeepSpeed's CPU accelerator: ``zero.Init`` partitions
    parameters made with ``torch.FloatTensor`` (same objects, partitions on the accelerator). On XLA the module's own
    parameters draw from the XLA generator, so the two host-made ones are torch's first two CPU draws, kept (in bf16)
    through the move."""
    import json
    from tests.multiproc import run_ranks
    proc, = run_ranks("tests.patches.test_zero:zero_init_subclass_param", 1, env={"DS_ACCELERATOR": accelerator})
    assert proc.returncode == 0, proc.stderr[-6000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(found["partitioned"]) == {"param", "conv1.weight", "conv1.bias", "conv1.param_in"}
    assert all(found["partitioned"].values()), found["partitioned"]
    assert set(found["held_on"].values()) == {accelerator}
    assert found["same_objects"]
    shapes = {name: list(torch.tensor(values).shape) for name, values in found["gathered"].items()}
    assert shapes == {"param": [5], "conv1.weight": [3, 1, 4], "conv1.bias": [3], "conv1.param_in": [5]}
    if accelerator == "xla":
        torch.manual_seed(0)
        first, second = torch.FloatTensor(5).uniform_(), torch.FloatTensor(5).uniform_()
        for name, drawn in (("conv1.param_in", first), ("param", second)):
            torch.testing.assert_close(torch.tensor(found["gathered"][name]), drawn.bfloat16().float())


def offload_overflow_flags() -> None:
    """A rank: ZeRO-2 with the optimizer offloaded, DeepSpeed's overflow flag after a finite backward and after one
    whose gradients hold NaN, with the norm DeepSpeed sums from the per-parameter norms."""
    import json
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.ones(2, 4).to(engine.device)
    found = {}
    for name, scale in (("finite", 1.0), ("nan", float("nan"))):
        engine.backward(engine(x).sum() * scale)
        norm = optimizer.complete_grad_norm_calculation_for_cpu_offload(optimizer.params_in_partition[0])
        found[name] = {"overflow": bool(optimizer.local_overflow), "norm": float(norm)}
        engine.step()
    print(json.dumps(found))


def test_offload_reads_the_overflow_deepspeed_reads(tmp_path):
    """ZeRO-1/2 offload's overflow test and gradient norms, read in one transfer at the end of the backward, give
    what the CPU accelerator's per-parameter reads give: no overflow and the same norm for finite gradients, an
    overflow (and DeepSpeed's -1 for a norm that is not finite) for NaN ones."""
    import json
    from tests.multiproc import on_both_accelerators, run_ranks

    def launch(accelerator, _):
        proc, = run_ranks("tests.patches.test_zero:offload_overflow_flags", 1, env={"DS_ACCELERATOR": accelerator})
        assert proc.returncode == 0, proc.stderr[-6000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    xla, cpu = on_both_accelerators(launch, tmp_path)
    assert xla["finite"]["overflow"] is cpu["finite"]["overflow"] is False
    assert xla["nan"] == cpu["nan"] == {"overflow": True, "norm": -1.0}
    assert xla["finite"]["norm"] == pytest.approx(cpu["finite"]["norm"], rel=1e-6)


def zero2_norm_against_upstream() -> None:
    """A rank: ZeRO-2's patched gradient norm next to upstream's on the same gradients, for finite gradients (two
    steps, sizes that leave the last rank's partition padded) and for NaN ones."""
    import inspect
    import json
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    found = []
    patched = DeepSpeedZeroOptimizer.get_grad_norm_direct
    upstream = inspect.unwrap(patched)

    def grad_norm(self, gradients, params, norm_type=2):
        mine = patched(self, gradients, params, norm_type)
        found.append((float(upstream(self, gradients, params, norm_type)), float(mine)))
        return mine

    DeepSpeedZeroOptimizer.get_grad_norm_direct = grad_norm
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 2}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(4, 7).to(engine.device)
    for scale in (1.0, 1.0, float("nan")):
        engine.backward(engine(x).pow(2).mean() * scale)
        engine.step()
    print(json.dumps({"patched": patched is not upstream, "norms": found}))


def test_zero2_norm_is_upstreams():
    """ZeRO-1/2's norm from the gradients' sum of squares (one element operation per gradient element where upstream
    has |g| and |g|²: tests/bench/test_cost.py counts them) equals upstream's to rounding on 2 ranks, and is
    DeepSpeed's -1 for NaN gradients."""
    import json
    from tests.multiproc import run_ranks
    for proc in run_ranks("tests.patches.test_zero:zero2_norm_against_upstream", 2, env={"DS_ACCELERATOR": "xla"}):
        assert proc.returncode == 0, proc.stderr[-6000:]
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        assert found["patched"]
        (first, first_mine), (second, second_mine), nan = found["norms"]
        assert first > 0 and second > 0
        assert first_mine == pytest.approx(first, rel=1e-6) and second_mine == pytest.approx(second, rel=1e-6)
        assert nan == [-1.0, -1.0]


def zero_bf16_against_upstream() -> None:
    """A rank: two bf16 ZeRO engines (the stage is ``sys.argv[1]``) trained alike, one with ZeRO-1/2's single gradient
    conversion and one with upstream's ``scaled_global_norm``; their norms, fp32 weight partitions and Adam moments."""
    import inspect
    import json
    import sys
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    patched = DeepSpeedZeroOptimizer.scaled_global_norm
    norm_dtypes = []
    upstream_norm = DeepSpeedZeroOptimizer.get_grad_norm_direct

    def grad_norm(self, gradients, params, norm_type=2):
        norm_dtypes.append(str(gradients[0].dtype))
        return upstream_norm(self, gradients, params, norm_type)

    DeepSpeedZeroOptimizer.get_grad_norm_direct = grad_norm
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "bf16": {"enabled": True}, "gradient_clipping": 0.5, "zero_optimization": {"stage": int(sys.argv[1])}}
    found = {}
    for name, method in (("patched", patched), ("upstream", inspect.unwrap(patched))):
        DeepSpeedZeroOptimizer.scaled_global_norm = method
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        norms = []
        for step in range(3):
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * step + engine.global_rank))
            engine.backward(engine(x.to(engine.device, torch.bfloat16)).float().pow(2).mean())
            engine.step()
            norms.append(float(engine.get_global_grad_norm()))
        optimizer = engine.optimizer
        state = optimizer.optimizer.state[optimizer.single_partition_of_fp32_groups[0]]
        found[name] = {"norms": norms, "dtypes": norm_dtypes[:],
                       "tensors": [t.cpu().tolist() for t in (optimizer.single_partition_of_fp32_groups[0],
                                                              state["exp_avg"], state["exp_avg_sq"])]}
        norm_dtypes.clear()
        engine.destroy()
    DeepSpeedZeroOptimizer.scaled_global_norm = patched
    print(json.dumps({"patched": patched is not inspect.unwrap(patched), **found}))


@pytest.mark.parametrize("stage", ["1", "2"])
def test_zero_bf16_converts_each_gradient_once_with_upstreams_values(stage):
    """bf16 ZeRO-1/2 convert each gradient to fp32 once (the norm and the optimizer's flat partition share it:
    tests/bench/test_cost.py counts the step graph) and train exactly as upstream on 2 ranks, whose last partition is
    padded and whose data differ."""
    import json
    from tests.multiproc import run_ranks
    procs = run_ranks("tests.patches.test_zero:zero_bf16_against_upstream", 2, env={"DS_ACCELERATOR": "xla"},
                      args=[stage])
    ranks = []
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-6000:]
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        assert found["patched"]
        assert set(found["patched"]["dtypes"]) == {"torch.float32"}
        assert set(found["upstream"]["dtypes"]) == {"torch.bfloat16"}
        assert found["patched"]["norms"] == found["upstream"]["norms"]
        assert found["patched"]["tensors"] == found["upstream"]["tensors"]
        ranks.append(found["patched"]["tensors"][0])
    assert ranks[0] != ranks[1]  # each rank holds its own partition
