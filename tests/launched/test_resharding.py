"""Checkpoints that change shape: resumed by another ZeRO stage, or on another number of ranks through DeepSpeed's
universal checkpoint, each against DeepSpeed's CPU accelerator doing the same.

The checkpoints are the shared 2-rank runs' (``TWO_RANK_RUN``, saved at step 3), a 1-rank run's and a 2-stage
pipeline's. The resumes of converted checkpoints are planned once the conversion is done (``resharded``): one job per
accelerator and number of ranks. Which stage changes DeepSpeed cannot load: docs/checkpoints.md, 'Another ZeRO stage'.
"""
import shutil
import sys
from pathlib import Path

import pytest

from deepspeed_xla.patches import checkpoints
from tests.conftest import FIXTURES, clean_env
from tests.multiproc import (LOSS_TOLERANCE, TWO_RANK_RUN, assert_trains_like, ds_config, plan, run_command,
                             training, training_command, within)

RESUMED_AT = TWO_RANK_RUN["save_at"][0]
RESUMED_STEPS = RESUMED_AT + 5
UNIVERSAL = {"checkpoint": {"load_universal": True}}
#: (saved by, loaded by): ZeRO stages whose checkpoints DeepSpeed loads into the other.
STAGE_CHANGES = [(1, 2), (2, 1)]


def saved(accelerator: str, stage: int) -> dict:
    """The shared 2-rank run of ``stage`` that saved at step ``RESUMED_AT``."""
    return training(accelerator, ds_config(stage), **TWO_RANK_RUN)


def stage_changed(accelerator: str, saved_stage: int, stage: int) -> dict:
    """``stage`` resumes the checkpoint ``saved(accelerator, saved_stage)`` wrote, on 2 ranks."""
    return training(accelerator, ds_config(stage), num_procs=2, steps=RESUMED_STEPS,
                    load_from=saved(accelerator, saved_stage))


#: The 1-rank ZeRO-2 run whose checkpoint is resumed on 2 ranks; the pipelines (ZeRO-1) of 1 and 2 stages, on as
#: many ranks, each resumed with the other number of stages.
ONE_RANK_SAVE = training("xla", ds_config(2), steps=RESUMED_AT + 1, save_at=(RESUMED_AT, ))
PIPELINE = ds_config(1, micro_batch=2, accumulation=4)
PIPELINE_SAVES = {stages: training("xla", PIPELINE, num_procs=stages, steps=RESUMED_AT + 1, save_at=(RESUMED_AT, ),
                                   train_args=("--pipeline-stages", str(stages))) for stages in (1, 2)}
plan("resharding", ONE_RANK_SAVE, *PIPELINE_SAVES.values(),
     *(stage_changed(accelerator, *change) for accelerator in ("xla", "cpu") for change in STAGE_CHANGES))


def to_universal(save_dir: Path, into: Path) -> Path:
    """A copy of ``save_dir`` with its step-``RESUMED_AT`` checkpoint converted by DeepSpeed's ``ds_to_universal``
    (without torch_xla, as on a machine without it)."""
    shutil.copytree(save_dir, into)
    tag = f"global_step{RESUMED_AT}"
    convert = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state",
               "--input_folder", str(into / tag), "--output_folder", str(into / f"{tag}_universal")]
    proc = run_command(convert, 300, env=clean_env(DS_ACCELERATOR="cpu", PYTHONPATH=FIXTURES / "no_torch_xla"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return into


@pytest.fixture(scope="module")
def resharded(trainings, tmp_path_factory):
    """The universal resumes, planned once their checkpoints are converted: 2 ranks resume the 1-rank checkpoint,
    and each pipeline's resumes with the other number of stages; one job per accelerator and number of ranks."""
    root = tmp_path_factory.mktemp("universal")
    one_rank = to_universal(trainings.result(ONE_RANK_SAVE)["save_dir"], root / "one-rank")
    pipelines = {stages: to_universal(trainings.result(spec)["save_dir"], root / f"pipeline{stages}")
                 for stages, spec in PIPELINE_SAVES.items()}
    runs = {}
    for accelerator in ("xla", "cpu"):
        runs["two-ranks", accelerator] = training(accelerator, {**ds_config(2), **UNIVERSAL}, num_procs=2,
                                                  steps=RESUMED_STEPS, train_args=("--load-dir", str(one_rank)))
        for saved_stages, stages in ((2, 1), (1, 2)):
            runs["pipeline", accelerator, saved_stages] = training(
                accelerator, {**PIPELINE, **UNIVERSAL}, num_procs=stages, steps=RESUMED_STEPS,
                train_args=("--pipeline-stages", str(stages), "--load-dir", str(pipelines[saved_stages])))
    plan("resharding-universal", *runs.values())
    return {key: trainings.result(spec) for key, spec in runs.items()}


def first_steps(run: dict, count: int) -> list:
    return run["losses"][RESUMED_AT:RESUMED_AT + count]


@pytest.mark.parametrize("saved_stage, stage", STAGE_CHANGES, ids=["zero1-to-zero2", "zero2-to-zero1"])
def test_zero_1_and_2_resume_each_others_checkpoints(trainings, saved_stage, stage):
    """DeepSpeed's ZeRO-1 and ZeRO-2 write the same files: either loads the other's, on XLA as on the CPU
    accelerator, and goes on as the saved run did (the Adam moments and step count came back)."""
    xla, cpu = (trainings.result(stage_changed(accelerator, saved_stage, stage)) for accelerator in ("xla", "cpu"))
    assert xla["first_step"] == RESUMED_AT and len(xla["losses"]) == RESUMED_STEPS - RESUMED_AT
    assert_trains_like(xla, cpu, "float32")
    uninterrupted = trainings.result(saved("xla", saved_stage))
    assert xla["losses"][0] == uninterrupted["losses"][RESUMED_AT]  # the same weights, the same batch
    assert within(xla["losses"], first_steps(uninterrupted, len(xla["losses"])), **LOSS_TOLERANCE["float32"])


def test_universal_checkpoint_resumes_on_two_ranks(trainings, resharded):
    """A 1-rank ZeRO-2 checkpoint, converted by ``ds_to_universal``, resumes on 2 ranks: rank 0's first loss is the
    1-rank run's at that step (same weights, same batch), and the steps after it train as the same checkpoint does on
    DeepSpeed's CPU accelerator."""
    xla, cpu = resharded["two-ranks", "xla"], resharded["two-ranks", "cpu"]
    assert xla["first_step"] == RESUMED_AT and xla["world_size"] == 2
    assert xla["losses"][0] == trainings.result(ONE_RANK_SAVE)["losses"][RESUMED_AT]
    assert_trains_like(xla, cpu, "float32")


@pytest.mark.parametrize("saved_stages", [2, 1], ids=["2-stages-to-1", "1-stage-to-2"])
def test_universal_pipeline_checkpoint_resumes_on_another_number_of_stages(trainings, resharded, saved_stages):
    """A pipeline's checkpoint, converted, resumes with the other number of stages (as many ranks): its first loss is
    the saving run's at that step, and it trains on as the same checkpoint does on DeepSpeed's CPU accelerator. The
    tied embedding's parameters come from the first stage (``scripts/train.py`` names them replicated)."""
    xla, cpu = resharded["pipeline", "xla", saved_stages], resharded["pipeline", "cpu", saved_stages]
    assert xla["first_step"] == RESUMED_AT and xla["world_size"] == 3 - saved_stages
    saved_losses = trainings.result(PIPELINE_SAVES[saved_stages])["losses"]
    assert within(xla["losses"][:1], saved_losses[RESUMED_AT:], **LOSS_TOLERANCE["float32"]), (xla, saved_losses)
    assert_trains_like(xla, cpu, "float32")


#: (saved by, loaded by, with optimizer states) -> whether DeepSpeed 0.19.8 loads it, on its CPU accelerator as on
#: XLA (run by hand: every pair of stages 0-3, also with load_optimizer_states=False and as a universal checkpoint).
STAGE_PAIRS = {(saved_stage, stage, states): (saved_stage == 3) == (stage == 3) and (
    not states or (saved_stage == 0) == (stage == 0)) for saved_stage in range(4) for stage in range(4)
    for states in (True, False) if saved_stage != stage}


@pytest.mark.parametrize("saved_stage, stage, states", STAGE_PAIRS, ids=str)
def test_stage_changes_deepspeed_cannot_load_name_both_stages_and_the_way_out(saved_stage, stage, states):
    problem = checkpoints._stage_change_problem("ckpt", "global_step3", saved_stage, stage, states)
    if STAGE_PAIRS[saved_stage, stage, states]:
        assert problem is None
        return
    assert problem.startswith(f"deepspeed_xla: this checkpoint ({Path('ckpt', 'global_step3')}) was saved by ZeRO "
                              f"stage {saved_stage} and is loaded by stage {stage}. "), problem
    assert f'Resume with "stage": {saved_stage} in the config' in problem, problem
    if 3 not in (saved_stage, stage):
        way_out = "engine.load_checkpoint(..., load_optimizer_states=False)"
    elif saved_stage:
        way_out = "python ckpt/zero_to_fp32.py ckpt <output folder> --tag global_step3 writes them"
    else:
        way_out = 'they are the "module" entry of ckpt/global_step3/*model_states.pt'
    assert way_out in problem, problem


def test_zero_3_resuming_a_zero_2_checkpoint_stops_naming_both_stages(trainings, tmp_path):
    """End to end on 2 ranks: the saved stage is read from the checkpoint at ``load_checkpoint``, before DeepSpeed's
    bare ``AssertionError``."""
    folder = trainings.result(saved("xla", 2))["save_dir"]
    cmd, env, _ = training_command(tmp_path, "xla", ds_config(3), num_procs=2, steps=RESUMED_AT + 2,
                                   train_args=("--load-dir", str(folder)))
    proc = run_command(cmd, 600, cwd=tmp_path, env=env)
    output = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode != 0, output
    assert (f"deepspeed_xla: this checkpoint ({folder / f'global_step{RESUMED_AT}'}) was saved by ZeRO stage 2 and "
            "is loaded by stage 3. ") in output, output
    assert "AssertionError" not in output, output
