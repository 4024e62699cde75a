"""Multi-process helpers, in one place: commands in their own session (``commands``), ranks of one function forked
from a fork server (``forking``), ``scripts/train.py`` through the real launchers (``launching``), the trainings a
session shares (``trainings``), per-rank records on both accelerators (``records``) and the comparison of two runs
(``comparison``). Tests import the names from here."""
from deepspeed_xla.launch_env import free_port
from tests.conftest import REPO, clean_env
from tests.multiproc.commands import (kill_group, last_error, remove_cpu_comm_buffers, run_command, run_jobs, run_python,
                                      start_command)
from tests.multiproc.comparison import (KEY_BIAS_ATOL, LOSS_TOLERANCE, PARAM_TOLERANCE, assert_trains_like,
                                        assert_weights_like, trained_alike, training_dtype, within)
from tests.multiproc.forking import _SERVERS, FORK_SERVER, run_ranks, start_ranks
from tests.multiproc.launching import (TRAIN, TRAIN_MANY, TWO_RANK_RUN, WARMUP_STEPS, accelerator_env, ds_config,
                                       launch_command, ranks, read_results, run_forked_job,
                                       run_job, run_training, train_arguments, training_command)
from tests.multiproc.records import (on_both_accelerators, record_cases, records_on_both_accelerators,
                                     run_rank_records)
from tests.multiproc.trainings import Trainings, counts_per_step, plan, plan_against_cpu, training

__all__ = [
    "FORK_SERVER", "KEY_BIAS_ATOL", "LOSS_TOLERANCE", "PARAM_TOLERANCE", "REPO", "TRAIN", "TRAIN_MANY", "TWO_RANK_RUN",
    "WARMUP_STEPS", "Trainings", "_SERVERS", "accelerator_env", "assert_trains_like", "assert_weights_like",
    "clean_env", "counts_per_step", "ds_config", "free_port", "kill_group", "last_error", "launch_command",
    "on_both_accelerators", "plan", "plan_against_cpu", "ranks", "read_results", "record_cases",
    "records_on_both_accelerators", "remove_cpu_comm_buffers", "run_command", "run_forked_job", "run_job", "run_jobs",
    "run_python", "run_rank_records", "run_ranks", "run_training", "start_command", "start_ranks", "train_arguments",
    "trained_alike", "training", "training_command", "training_dtype", "within"
]
