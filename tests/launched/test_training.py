"""One XLA process trains exactly like DeepSpeed's own CPU accelerator (same seed, same data).

Both sides run ``python scripts/train.py`` as one process (``tests.multiproc.Trainings``; the multi-process tests
go through the ``deepspeed`` CLI); the reference is computed in the same test. ``tests.multiproc.assert_trains_like``
compares the per-step losses and the final weights.
"""
import math
import re

import pytest

from tests.multiproc import (assert_trains_like, counts_per_step, ds_config, plan, plan_against_cpu, training,
                             training_dtype)

# Its trainings are its own (the plan group "one-process"): under ``pytest -n`` it needs no other module's worker.
pytestmark = pytest.mark.xdist_group("one-process-trainings")

# bf16 ZeRO-1 accumulating gradients in fp32 runs DeepSpeed's BF16_Optimizer (as bf16 pipelines do).
BF16_OPTIMIZER = {"data_types": {"grad_accum_dtype": "fp32"}}
BF16_OPTIMIZER_CONFIG = ds_config(1, bf16=True, accumulation=2, gradient_clipping=0.5, **BF16_OPTIMIZER)
CLIENT_OPTIMIZER_STAGES = [2, 3]
NAN_SKIP_CASES = {"zero1": (1, False), "zero3": (3, False), "bf16-zero0": (0, True)}
# How each test below runs train.py (the same arguments in its plan and in its request).
CLIENT_OPTIMIZER_RUN = {"steps": 8, "train_args": ("--client-optimizer", )}
NAN_SKIP_RUN = {"steps": 7, "train_args": ("--client-optimizer", "sgd", "--nan-grad-at", "3")}
BF16_OPTIMIZER_RUN = {"steps": 8}


def _client_optimizer_config(stage: int) -> dict:
    config = ds_config(stage, accumulation=2, gradient_clipping=0.5,
                       scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}})
    del config["optimizer"]
    return config


def _nan_skip_config(stage: int, bf16: bool) -> dict:
    return ds_config(stage, bf16=bf16, zero_allow_untested_optimizer=True)


# These run in one job per accelerator (tests.multiproc.plan); the XLA runs that dump their HLO in a job of their own.
for _stage in CLIENT_OPTIMIZER_STAGES:
    plan_against_cpu("one-process", _client_optimizer_config(_stage), **CLIENT_OPTIMIZER_RUN)
for _stage, _bf16 in NAN_SKIP_CASES.values():
    plan_against_cpu("one-process", _nan_skip_config(_stage, _bf16), **NAN_SKIP_RUN)
SINGLE_PROCESS_CONFIGS = {f"{stage}-{'bf16' if bf16 else 'fp32'}": ds_config(stage, bf16=bf16)
                          for stage in range(4) for bf16 in (False, True)}
for _accelerator, _dump_hlo in (("xla", True), ("cpu", False)):
    plan("one-process", *(training(_accelerator, config, dump_hlo=_dump_hlo)
                          for config in SINGLE_PROCESS_CONFIGS.values()),
         training(_accelerator, BF16_OPTIMIZER_CONFIG, dump_hlo=_dump_hlo, **BF16_OPTIMIZER_RUN))


@pytest.mark.parametrize("name", SINGLE_PROCESS_CONFIGS)
def test_single_process_losses_match_cpu_accelerator(trainings, name):
    config = SINGLE_PROCESS_CONFIGS[name]
    xla, cpu = trainings.against_cpu(config, dump_hlo=True)
    assert len(xla["losses"]) == 20
    assert xla["losses"][-1] < xla["losses"][0] - 0.5, "the model did not train"
    assert_trains_like(xla, cpu, training_dtype(config))
    # One graph per step and no host read but the loss the script prints: DeepSpeed's overflow and
    # norm checks stay on the device.
    assert counts_per_step(xla) == {"compilations": 0, "executions": 1, "transfers_to_host": 1}


@pytest.mark.parametrize("stage", CLIENT_OPTIMIZER_STAGES)
def test_client_optimizer_accumulation_clipping_and_scheduler(trainings, stage):
    """A torch optimizer built before ``initialize`` (on the CPU parameters), gradient accumulation,
    clipping and an LR schedule: the engine must move the model without orphaning the optimizer."""
    config = _client_optimizer_config(stage)
    xla, cpu = trainings.against_cpu(config, **CLIENT_OPTIMIZER_RUN)
    assert xla["losses"][-1] < xla["losses"][0]
    assert_trains_like(xla, cpu, training_dtype(config))


def test_bf16_optimizer_accumulation_and_clipping_match_cpu_accelerator(trainings):
    xla, cpu = trainings.against_cpu(BF16_OPTIMIZER_CONFIG, dump_hlo=True, **BF16_OPTIMIZER_RUN)
    assert xla["losses"][-1] < xla["losses"][0]
    assert_trains_like(xla, cpu, training_dtype(BF16_OPTIMIZER_CONFIG))
    # train.py reads each micro-batch's loss: one execution and one transfer each, nothing else.
    assert counts_per_step(xla) == {"compilations": 0, "executions": 2, "transfers_to_host": 2}


@pytest.mark.parametrize("stage,bf16", NAN_SKIP_CASES.values(), ids=NAN_SKIP_CASES)
def test_step_with_invalid_gradients_is_skipped_as_on_cpu(trainings, stage, bf16):
    """NaN gradients at step 3: DeepSpeed skips the step on the host (CPU), deepspeed_xla on the device.

    SGD with momentum keeps no step count, so the two skips leave exactly the same state."""
    config = _nan_skip_config(stage, bf16)
    xla, cpu = trainings.against_cpu(config, **NAN_SKIP_RUN)
    assert (xla["skipped_steps"], cpu["skipped_steps"]) == (1, 1)
    assert_trains_like(xla, cpu, training_dtype(config))
    # The skip stays on the device: one graph and one host read a step. bf16 without ZeRO and with a torch optimizer
    # is DeepSpeed's FP16_UnfusedOptimizer, which reads each gradient on the host upstream. The one compilation
    # after warm-up is the NaN step's own graph (its loss times NaN).
    assert counts_per_step(xla) == {"compilations": 1, "executions": 1, "transfers_to_host": 1}


def _select_sizes(hlo_dir) -> list:
    """Elements of each ``select`` in the biggest graph torch_xla handed XLA (its HLO before optimization)."""
    graphs = [path.read_text() for path in hlo_dir.glob("*before_optimizations.txt")]
    shapes = re.findall(r"= \w+\[([\d,]*)\]\S* select\(", max(graphs, key=len))
    return [math.prod(int(d) for d in dims.split(",") if d) for dims in shapes]


@pytest.mark.parametrize("config,run",
                         [pytest.param(config, {}, id=name) for name, config in SINGLE_PROCESS_CONFIGS.items()]
                         + [pytest.param(BF16_OPTIMIZER_CONFIG, BF16_OPTIMIZER_RUN, id="1-bf16-optimizer")])
def test_step_graph_does_not_copy_into_slices_of_flat_buffers(trainings, train_module, config, run):
    """torch_xla lowers a copy into a slice of a flat buffer as a select over the whole buffer, so
    copying each parameter's tensor into a flat buffer costs (parameters x buffer) element operations
    a step. Upstream does it with each gradient in ZeRO-1/2 (``contiguous_gradients``), ZeRO-3
    (``partition_grads``) and ``BF16_Optimizer`` (``update_hp_grads``), and with each updated weight
    in bf16 without ZeRO (``FP16_Optimizer.step``).

    The graphs are those of the parity runs above (their XLA side dumps its HLO): the run is shared."""
    hlo = trainings.run("xla", config, dump_hlo=True, **run)["hlo_dir"]
    model = train_module.TinyGPT(64, 32, 2, seq=16)  # train.py's defaults
    largest = max(p.numel() for p in model.parameters())
    # Left: step_guard's torch.where over the flat fp32 parameters and Adam's two moments (fp32
    # without ZeRO keeps no flat buffer). Each of the upstream copies would add one per parameter
    # (33 for these 30; 63 in ZeRO-1/2, which copy each gradient twice).
    fp32_without_zero = config["zero_optimization"]["stage"] == 0 and training_dtype(config) == "float32"
    assert len([n for n in _select_sizes(hlo) if n > largest]) == (0 if fp32_without_zero else 3)
