"""``comm/timeouts.py``: the collective timeout and the heartbeat timeout are set apart, each by its own variable."""
from datetime import timedelta

import pytest

from deepspeed_xla.comm import timeouts


def test_comm_timeout_is_seconds_and_names_the_variable_when_wrong(monkeypatch):
    default = timedelta(minutes=10)
    monkeypatch.delenv(timeouts.TIMEOUT_ENV, raising=False)
    assert timeouts.comm_timeout(default) == default
    monkeypatch.setenv(timeouts.TIMEOUT_ENV, "2.5")
    assert timeouts.comm_timeout(default) == timedelta(seconds=2.5)
    for wrong in ("soon", "0", "-3"):
        monkeypatch.setenv(timeouts.TIMEOUT_ENV, wrong)
        with pytest.raises(ValueError, match=f"{timeouts.TIMEOUT_ENV}=.*number of seconds"):
            timeouts.comm_timeout(default)


def test_the_heartbeat_timeout_does_not_grow_with_the_collective_timeout(monkeypatch):
    """Users raise the collective timeout above their longest compilation (half an hour, say): a lost TPU host must
    still be noticed within a minute."""
    monkeypatch.delenv(timeouts.HEARTBEAT_ENV, raising=False)
    monkeypatch.setenv(timeouts.TIMEOUT_ENV, "1800")
    assert timeouts.comm_timeout(timedelta(minutes=10)) == timedelta(minutes=30)
    assert timeouts.heartbeat_timeout() == 60.0
    monkeypatch.setenv(timeouts.HEARTBEAT_ENV, "7.5")
    assert timeouts.heartbeat_timeout() == 7.5
    for wrong in ("soon", "0", "-3"):
        monkeypatch.setenv(timeouts.HEARTBEAT_ENV, wrong)
        with pytest.raises(ValueError, match=f"{timeouts.HEARTBEAT_ENV}=.*number of seconds"):
            timeouts.heartbeat_timeout()
