"""Checkpoint on SIGTERM (``DS_XLA_CHECKPOINT_ON_SIGTERM``): a 2-rank ZeRO-2 ``scripts/train.py`` job through the
``deepspeed`` CLI whose rank 1, or every rank, gets SIGTERM in the middle of a step saves one complete checkpoint on
every rank at one step, stops with SIGTERM's exit code naming it, and a new job resumes from that checkpoint to the
losses and weights of the uninterrupted run (``tests/launched/test_checkpoint.py``'s ZeRO-2 run)."""
import re

import pytest

from deepspeed_xla.comm.preemption import SAVE_DIR_ENV
from deepspeed_xla.comm.watchdog import TERMINATED_EXIT_CODE
from tests.conftest import FIXTURES
from tests.launched.test_checkpoint import load_without_torch_xla
from tests.multiproc import TWO_RANK_RUN, ds_config, ranks, run_jobs, training, training_command

CONFIG = ds_config(2)
SIGTERM_IN_BACKWARD = 6  # train.py runs one backward per step: SIGTERM comes during step 5, after 5 completed
SAVED_AT = SIGTERM_IN_BACKWARD - 1 + 2  # two past the steps the first rank that got SIGTERM had completed
#: the ranks that get SIGTERM (the fixture's DSX_TEST_SIGTERM_AT) -> the ranks the stop message may name
PREEMPTED = {"1": "1", "0,1": "[01]"}
ZERO2_FILES = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
               "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """Both jobs at once, each the uninterrupted run's training with a checkpoint on SIGTERM asked for and SIGTERM
    sent to the ranks of ``PREEMPTED`` by ``tests/fixtures/fault_injection``: {ranks: (save dir, exit code,
    output)}."""
    jobs, save_dirs = {}, {}
    for preempted_ranks in PREEMPTED:
        workdir = tmp_path_factory.mktemp("sigterm")
        env = {"PYTHONPATH": FIXTURES / "fault_injection",
               "DSX_TEST_SIGTERM_AT": f"{preempted_ranks}:{SIGTERM_IN_BACKWARD}", SAVE_DIR_ENV: workdir / "preempted"}
        cmd, env, _ = training_command(workdir, "xla", CONFIG, num_procs=2, steps=TWO_RANK_RUN["steps"],
                                       extra_env=env)
        jobs[preempted_ranks], save_dirs[preempted_ranks] = (cmd, env, workdir), workdir / "preempted"
    return {ranks_: (save_dirs[ranks_], *result) for ranks_, result in run_jobs(jobs).items()}


@pytest.mark.parametrize("preempted_ranks", PREEMPTED, ids=["rank1", "every_rank"])
def test_sigterm_saves_a_complete_checkpoint_on_every_rank_then_stops_naming_it(preempted, preempted_ranks, trainings):
    save_dir, code, output = preempted[preempted_ranks]
    for rank in preempted_ranks.split(","):
        assert f"SIGTERM to rank {rank} in backward {SIGTERM_IN_BACKWARD}" in output, output[-6000:]
    assert code == TERMINATED_EXIT_CODE, f"{code}\n{output[-6000:]}"
    tag = f"global_step{SAVED_AT}"
    for rank in (0, 1):
        stop = (rf"\[deepspeed_xla\] rank {rank} stops: rank {PREEMPTED[preempted_ranks]} got SIGTERM: preempted .*; "
                rf"every rank saved checkpoint {tag} in {re.escape(str(save_dir))} before stopping \({SAVE_DIR_ENV}\)")
        assert re.search(stop, output), output[-6000:]
    assert (save_dir / "latest").read_text() == tag
    assert sorted(p.name for p in save_dir.iterdir() if p.is_dir()) == [tag]
    loaded = load_without_torch_xla(save_dir, tag)
    assert not loaded["torch_xla_loaded"]
    assert sorted(loaded["devices"]) == [f"{tag}/{name}" for name in ZERO2_FILES], loaded["devices"]
    assert all(devices == ["cpu"] for devices in loaded["devices"].values()), loaded["devices"]
    assert all(max(steps) == SAVED_AT for steps in loaded["steps"].values()), loaded["steps"]  # all of one step
    assert loaded["fp32"].keys() == trainings.result(training("xla", CONFIG, **TWO_RANK_RUN))["params"].keys()


def test_a_job_resumed_from_the_sigterm_checkpoint_repeats_the_uninterrupted_run(preempted, trainings):
    save_dir = preempted["1"][0]
    full = trainings.result(training("xla", CONFIG, **TWO_RANK_RUN))
    resumed = trainings.run("xla", CONFIG, num_procs=2, steps=TWO_RANK_RUN["steps"],
                            train_args=("--load-dir", str(save_dir)))
    assert resumed["first_step"] == SAVED_AT
    assert resumed["losses"] == full["losses"][SAVED_AT:]
    for mine, theirs in zip(ranks(resumed), ranks(full), strict=True):
        assert mine["params"] == theirs["params"], f"rank {mine['rank']}"
