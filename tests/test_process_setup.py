"""The per-process setup's checks that need no second process."""
import pytest

from deepspeed_xla import process_setup


def test_rank_and_xla_ordinal_must_agree(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(process_setup.xla_runtime, "global_ordinal", lambda: 3)
    process_setup._check_ordinal()
    monkeypatch.setattr(process_setup.xla_runtime, "global_ordinal", lambda: 5)
    with pytest.raises(RuntimeError, match=r"RANK=3 but XLA global ordinal 5: .* hostfile in TPU worker-id order"):
        process_setup._check_ordinal()
