"""``comm/authentication.py``: with a job secret, a control value in the rendezvous store counts only if a rank of the
job signed it for that key; whoever else reaches MASTER_PORT can no longer stop every rank with a message of their
choosing, or make them save and exit."""
from datetime import timedelta

import pytest
import torch.distributed as dist

from deepspeed_xla.comm import authentication, failure, preemption
from deepspeed_xla.launch_env import free_port


def test_values_are_taken_as_they_are_without_a_secret(monkeypatch):
    monkeypatch.delenv(authentication.SECRET_ENV, raising=False)
    signer = authentication.Signer(0)
    assert signer.sign("failed", "rank 1 raised X") == "rank 1 raised X"
    assert signer.verify("failed", b"anything") == "anything"


def test_a_value_counts_only_signed_with_the_job_secret_for_its_key(capsys):
    ours, theirs = authentication.Signer(0, "job secret"), authentication.Signer(1, "another secret")
    signed = ours.sign("failed", "rank 1 raised X").encode()
    assert authentication.Signer(3, "job secret").verify("failed", signed) == "rank 1 raised X"
    assert ours.verify("failed", b"rank 1 raised X") is None  # unsigned
    assert ours.verify("failed", theirs.sign("failed", "rank 1 raised X").encode()) is None  # another secret
    assert ours.verify("proc/1", ours.sign("proc/2", "ns 12 34").encode()) is None  # moved to another key
    err = capsys.readouterr().err
    assert err.count("rank 0 ignores the value under 'failed'") == 1 and err.count("under 'proc/1'") == 1, err


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)


def test_a_forged_failure_stops_no_rank(store, monkeypatch, capsys):
    monkeypatch.setenv(authentication.SECRET_ENV, "job secret")
    store.set(failure.FAILED, "rank 0 raised RuntimeError: \x1b[31mrun rm -rf ~ to fix")
    record = failure.FailureRecord(store, 1)
    assert record.published() is None
    assert record.publish("rank 1 sent no heartbeat") == "rank 1 sent no heartbeat"  # what this rank prints
    assert "rank 1 ignores the value under 'failed'" in capsys.readouterr().err
    store.delete_key(failure.FAILED)
    assert record.publish("rank 1 sent no heartbeat") == "rank 1 sent no heartbeat"
    assert failure.FailureRecord(store, 0).published() == "rank 1 sent no heartbeat"


def test_a_forged_checkpoint_step_saves_nothing(store, tmp_path, monkeypatch):
    monkeypatch.setenv(authentication.SECRET_ENV, "job secret")
    rank0, rank1 = (preemption.CheckpointOnSigterm(store, rank, str(tmp_path)) for rank in (0, 1))
    rank0._store.set("target", "4 1")
    assert not rank0.step_ended(3) and not rank0.step_ended(4) and rank0.target is None
    rank0._store.delete_key("target")
    assert not rank1.step_ended(4)
    rank1.sigterm()
    assert [rank0.step_ended(5), rank0.step_ended(6), rank1.step_ended(6)] == [False, True, True]


@pytest.mark.parametrize("secrets, agree", [(("topsecret", "topsecret"), True), (("", ""), True),
                                            (("topsecret", ""), False), (("", "topsecret"), False),
                                            (("topsecret", "other"), False)])
def test_every_rank_has_rank_0s_secret_or_none_has_one(store, secrets, agree):
    for rank, secret in enumerate(secrets):
        if agree or rank == 0:
            authentication.same_secret(store, rank, authentication.Signer(rank, secret), timedelta(seconds=5))
        else:
            with pytest.raises(ValueError, match="DS_XLA_JOB_SECRET differs between rank 0 and rank 1 .* set one "
                                                 "value on every host, or unset it on every host"):
                authentication.same_secret(store, rank, authentication.Signer(rank, secret), timedelta(seconds=5))
    assert b"topsecret" not in store.get("secret/0")  # what is compared is signed with the secret, not the secret
