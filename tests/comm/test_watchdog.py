"""``comm/watchdog.py``: a collective that failed stops the job naming the failed rank, or says which rank it waited
for and which timeout to raise. (The parts: test_heartbeat.py, test_failure.py, test_signals.py, test_processes.py;
the watchdog in running jobs: tests/launched/test_faults.py.)"""
import pytest

from deepspeed_xla.comm import watchdog


class _Searched:
    """A rank's watchdog after its search for a failed rank found none."""
    rank, timeout, collective_timeout, collective = 0, 60.0, 1800.0, None

    def __init__(self, busy, doing=None):
        self.busy, self.doing = busy, doing

    def busy_ranks(self):
        return self.busy

    def waits(self):
        return {}

    def find_failure(self):
        return None

    def compiling(self, rank):
        return self.doing


@pytest.mark.parametrize("busy, doing, message", [
    ([1], None, "rank 1 did not join the collective that rank 0 waited in for DS_XLA_COMM_TIMEOUT=1800 s, and is "
     "alive: still compiling or computing"),
    ([1], "compiling the step graph (first step) for 1900 s", "rank 1 did not join the collective that rank 0 "
     "waited in for DS_XLA_COMM_TIMEOUT=1800 s, and is alive: it is compiling the step graph \\(first step\\) for "
     "1900 s so far, not hung"),
    ([], None, "a collective failed on rank 0 and no rank was found dead within DS_XLA_HEARTBEAT_TIMEOUT=60 s"),
])
def test_a_failed_collective_names_the_timeout_that_applies(monkeypatch, busy, doing, message):
    """A rank that has not joined waited out the collective timeout (a rank that said it compiles is named
    compiling, with its graph: ``compile_watch``); the search for a dead one, the heartbeat's."""
    monkeypatch.setattr(watchdog, "_watchdog", _Searched(busy, doing))
    with pytest.raises(RuntimeError, match=message) as raised:
        watchdog.explain_failure(RuntimeError("gloo: timed out"))
    with pytest.raises(RuntimeError) as again:  # an error it raised passes through unchanged
        watchdog.explain_failure(raised.value)
    assert again.value is raised.value and str(raised.value).endswith("gloo: timed out")
