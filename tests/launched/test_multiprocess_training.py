"""``deepspeed --num_gpus 2`` on XLA: ZeRO 0-3 train like DeepSpeed's CPU accelerator over gloo.

Both sides run through the real CLI in the same test; the XLA side uses the host-staged backend.
"""
import json

import pytest

from tests.conftest import FIXTURES
from tests.multiproc import (TWO_RANK_RUN, assert_trains_like, counts_per_step, ds_config, plan_against_cpu, ranks,
                             run_training, training_dtype)

# PJRT CPU has no XLA collectives, so each host-staged collective first runs the graph computing its operands:
# ZeRO-1/2 run 4 graphs per step, ZeRO-3 5 (docs/performance.md, "Two processes on PJRT CPU"); ZeRO-0, where the
# engine all-reduces the gradients itself, 3 in fp32 and 2 in bf16 (measured). By (stage, bf16):
EXECUTIONS_PER_STEP = {(0, False): 3, (0, True): 2, (1, False): 4, (1, True): 4, (2, False): 4, (2, True): 4,
                       (3, False): 5, (3, True): 5}
PROBE_DIR = FIXTURES / "runtime_probe"
STAGES, PRECISIONS = [0, 1, 2, 3], {"fp32": False, "bf16": True}
PERSISTENT_RUN = {"num_procs": 2, "steps": 6}


def _persistent_config() -> dict:
    config = ds_config(3)
    del config["zero_optimization"]["stage3_param_persistence_threshold"]
    return config


# One job per accelerator trains all of these (tests.multiproc.plan), with test_pipeline.py's 2-rank runs.
for _stage in STAGES:
    for _bf16 in PRECISIONS.values():
        plan_against_cpu("two-rank", ds_config(_stage, bf16=_bf16), **TWO_RANK_RUN)
plan_against_cpu("two-rank", _persistent_config(), **PERSISTENT_RUN)


@pytest.mark.parametrize("bf16", PRECISIONS.values(), ids=PRECISIONS)
@pytest.mark.parametrize("stage", STAGES)
def test_two_ranks_match_cpu_accelerator(trainings, stage, bf16):
    """ZeRO-0 is plain data parallel: DeepSpeed all-reduces the gradients itself. The XLA runs are the ones
    tests/launched/test_checkpoint.py resumes (``TWO_RANK_RUN``)."""
    config = ds_config(stage, bf16=bf16)
    xla, cpu = trainings.against_cpu(config, **TWO_RANK_RUN)
    assert xla["world_size"] == 2
    assert_trains_like(xla, cpu, training_dtype(config))
    assert [rank["params"] for rank in ranks(xla)[1:]] == [xla["params"]], "the ranks' weights differ"
    # Only the loss the script prints is read back, and nothing compiles after warm-up.
    assert counts_per_step(xla) == {"compilations": 0, "executions": EXECUTIONS_PER_STEP[stage, bf16],
                                    "transfers_to_host": 1}


def test_zero3_persistent_parameters_match_cpu_accelerator(trainings):
    """DeepSpeed's default ``stage3_param_persistence_threshold`` keeps this model's small parameters gathered
    between steps (``ds_config`` partitions every parameter): they are all-gathered together after each step."""
    config = _persistent_config()
    xla, cpu = trainings.against_cpu(config, **PERSISTENT_RUN)
    assert_trains_like(xla, cpu, training_dtype(config))
    # The post-step gathers of all persistent parameters run as one staged execution, not one per parameter.
    assert counts_per_step(xla) == {"compilations": 0, "executions": 4, "transfers_to_host": 1}


@pytest.fixture(scope="module")
def env_file_run(tmp_path_factory) -> dict:
    """2 ranks, 2 steps, with ``DS_ACCELERATOR=xla`` only in the working directory's ``.deepspeed_env``, every
    process recording at exit whether it started the XLA runtime (``runtime.jsonl``)."""
    workdir = tmp_path_factory.mktemp("env_file")
    (workdir / ".deepspeed_env").write_text("\n# set by the user\nexport DS_ACCELERATOR=xla\n\n")
    log = workdir / "runtime.jsonl"
    result = run_training(workdir, None, ds_config(2), num_procs=2, steps=2,
                          extra_env={"PYTHONPATH": str(PROBE_DIR), "DSX_TEST_RUNTIME_LOG": str(log)})
    return {**result, "runtime": [json.loads(line) for line in log.read_text().splitlines()]}


def test_launcher_processes_never_start_the_runtime(env_file_run):
    records = env_file_run["runtime"]
    launchers = [r for r in records if not r["argv"][0].endswith("train.py")]
    workers = [r for r in records if r["argv"][0].endswith("train.py")]
    assert len(workers) == 2 and all(r["runtime_started"] for r in workers)
    assert len(launchers) == 2, records  # the deepspeed runner and deepspeed.launcher.launch
    assert not any(r["runtime_started"] or r["torch_xla_imported"] for r in launchers), launchers


def test_ds_accelerator_from_deepspeed_env_file_only(env_file_run):
    assert env_file_run["accelerator"] == "xla"
    assert [rank["accelerator"] for rank in ranks(env_file_run)] == ["xla", "xla"]
