"""DeepSpeed's pipeline engine on XLA (``PipelineModule`` + ``train_batch``), against the CPU accelerator.

The model ties its embedding between the first and last stage; 4 micro-batches per step. On PJRT CPU
activations and gradients move through ``xla_host``; the TPU transfer path (``xla_ds``) is tested in
``tests/comm/test_xla_collectives.py``.
"""
import pytest

from tests.multiproc import TWO_RANK_RUN, assert_trains_like, ds_config, plan_against_cpu, ranks, training_dtype

TIED = "tied_modules.embed.tok.weight"


def _pipe_config(bf16=False, stage=0):
    return ds_config(stage, bf16=bf16, micro_batch=2, accumulation=4)


PIPE2 = ("--pipeline-stages", "2")
TWO_STAGE_RUNS = {False: TWO_RANK_RUN, True: {"num_procs": 2, "steps": 4}}
FOUR_RANKS = {"num_procs": 4, "steps": 4, "extra_env": {"CPU_NUM_DEVICES": 4}}
PIPE4_CHECKPOINTED = ("--pipeline-stages", "4", "--activation-checkpoint-interval", "1")


def _assert_no_compilation_after_warmup(result: dict) -> None:
    counters = result["counters"]
    assert counters["end"]["compilations"] == counters["warm"]["compilations"], counters


for _bf16, _run in TWO_STAGE_RUNS.items():  # with test_multiprocess_training.py's 2-rank runs
    plan_against_cpu("two-rank", _pipe_config(_bf16), train_args=PIPE2, **_run)
plan_against_cpu("four-rank", _pipe_config(stage=1), train_args=PIPE2, **FOUR_RANKS)
plan_against_cpu("four-rank", _pipe_config(), train_args=PIPE4_CHECKPOINTED, **FOUR_RANKS)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_two_stage_pipeline_matches_cpu_accelerator(trainings, bf16):
    """The fp32 run is the one tests/launched/test_checkpoint.py resumes (``TWO_RANK_RUN``)."""
    config = _pipe_config(bf16)
    xla, cpu = trainings.against_cpu(config, train_args=PIPE2, **TWO_STAGE_RUNS[bf16])
    assert_trains_like(xla, cpu, training_dtype(config))
    first, last = ranks(xla)
    assert first["params"][TIED] == last["params"][TIED], "tied embedding differs between first and last stage"
    for result in (first, last):
        _assert_no_compilation_after_warmup(result)


def test_pipe_2_by_data_2_with_zero_1_on_four_ranks(trainings):
    xla, cpu = trainings.against_cpu(_pipe_config(stage=1), train_args=PIPE2, **FOUR_RANKS)
    assert_trains_like(xla, cpu, "float32")
    tied = [r["params"][TIED] for r in ranks(xla)]
    assert all(t == tied[0] for t in tied), "tied embedding differs between stages or data-parallel replicas"


def test_four_stages_with_activation_checkpointing(trainings):
    """Tied weights on stages 0 and 3: their gradient all-reduce runs in a group that does not tile the world."""
    xla, cpu = trainings.against_cpu(_pipe_config(), train_args=PIPE4_CHECKPOINTED, **FOUR_RANKS)
    assert_trains_like(xla, cpu, "float32")
    first, *_, last = ranks(xla)
    assert first["params"][TIED] == last["params"][TIED], "tied embedding differs between stage 0 and stage 3"
    _assert_no_compilation_after_warmup(first)
