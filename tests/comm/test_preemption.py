"""``comm/preemption.py``: the ranks agree on one checkpoint step through the rendezvous store, whichever rank gets
SIGTERM and whenever. (A launched job that saves it: tests/launched/test_preemption.py.)"""
import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from deepspeed_xla.comm import preemption, watchdog
from deepspeed_xla.launch_env import free_port


@pytest.fixture
def agreements(tmp_path):
    """Two ranks' sides of the agreement, on one store served here (for as long as the test runs)."""
    store = dist.TCPStore("127.0.0.1", free_port(), 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    yield [preemption.CheckpointOnSigterm(store, rank, str(tmp_path)) for rank in (0, 1)]


def test_every_rank_saves_two_steps_past_the_sigterm_rank(agreements):
    rank0, rank1 = agreements
    assert not rank0.step_ended(6)  # rank 0 is a step ahead when SIGTERM comes to rank 1
    assert not rank1.step_ended(5)
    rank1.sigterm()
    rank0.sigterm()  # the host's SIGTERM reaches rank 0 later: the first target stands
    assert [rank0.step_ended(7), rank1.step_ended(6), rank1.step_ended(7)] == [True, False, True]
    assert rank0.saved("global_step7") == rank1.saved("global_step7")
    assert rank0.saved("global_step7").startswith("rank 1 got SIGTERM: preempted")


def test_sigterm_before_the_first_step_is_published_when_it_starts(agreements):
    rank0, rank1 = agreements
    rank1.sigterm()  # compiling the first step: this rank's step count is not known yet
    assert not rank0.step_ended(4)  # resumed at step 3: rank 0 completed its first step meanwhile
    rank1.step_started(3)
    assert [rank1.step_ended(4), rank1.step_ended(5), rank0.step_ended(5)] == [False, True, True]


def test_a_rank_past_the_target_stops_with_an_error(agreements):
    rank0, rank1 = agreements
    assert not rank0.step_ended(2)
    rank0.sigterm()
    with pytest.raises(RuntimeError, match="ran more than one optimizer step ahead"):
        rank1.step_ended(5)


def test_a_save_dir_that_cannot_be_made_names_the_variable(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(preemption.SAVE_DIR_ENV, str(tmp_path / "file" / "checkpoints"))
    with pytest.raises(ValueError, match=f"{preemption.SAVE_DIR_ENV}=.* cannot be made a folder"):
        preemption.save_dir_setting()
    monkeypatch.setenv(preemption.SAVE_DIR_ENV, str(tmp_path / "made"))
    assert preemption.save_dir_setting() == str(tmp_path / "made") and os.path.isdir(tmp_path / "made")


def test_one_rank_refuses_the_setting(monkeypatch, tmp_path):
    """No peers to agree with, no watchdog to catch SIGTERM: the setting would do nothing."""
    monkeypatch.setenv(preemption.SAVE_DIR_ENV, str(tmp_path))
    with pytest.raises(ValueError, match=f"{preemption.SAVE_DIR_ENV} is for jobs of 2 or more ranks"):
        watchdog.start(None, 0, 1, timedelta(seconds=10))


def test_a_sigterm_that_no_step_follows_is_overdue_after_the_bound(agreements):
    """SIGTERM while the first step compiles, in an evaluation, a data stall or a hang: without a step nothing brings
    the checkpoint closer, and the job must stop naming SIGTERM (the heartbeat thread asks ``overdue``)."""
    rank0, rank1 = agreements
    assert not rank1.overdue(0.0)  # no SIGTERM: never
    rank1.sigterm()
    assert not rank1.overdue(60.0)
    assert rank1.overdue(0.0)
    assert not rank0.overdue(0.0)  # the rank that got it is the one to stop
    rank1.step_started(3)
    assert not rank1.step_ended(4) and not rank1.overdue(60.0)  # a step ended: the bound starts again
    assert rank1.step_ended(5) and rank1.saving and not rank1.overdue(0.0)  # saving: the save's own waits apply
    assert rank1.unsaved(6.0, "DS_XLA_HEARTBEAT_TIMEOUT") == (
        "rank 1 got SIGTERM: preempted (a spot VM, a TPU maintenance event), or stopped by its scheduler or launcher; "
        "no optimizer step ended for DS_XLA_HEARTBEAT_TIMEOUT=6 s after it (the first compilation, an evaluation, a "
        f"data stall or a hang), so no checkpoint was saved ({preemption.SAVE_DIR_ENV})")


def test_a_malformed_checkpoint_step_in_the_store_is_ignored_and_said_once(agreements, capsys):
    """Whoever reaches MASTER_PORT can write the key; a value no rank wrote used to crash every rank at its step."""
    rank0, _ = agreements
    rank0._store.set("target", "\x1b[2Jnot a step")
    assert not rank0.step_ended(3) and not rank0.step_ended(4)
    err = capsys.readouterr().err
    assert err.count("rank 0 ignores the checkpoint step '\\x1b[2Jnot a step' in the rendezvous store") == 1, err
