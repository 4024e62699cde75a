"""``comm/failure.py``: the first failure is the one every rank prints, once, as it stops."""
import threading

import pytest

from deepspeed_xla.comm import failure


class _FailureStore:
    """The failure key alone: ``compare_set`` keeps the first value, as the rendezvous store does."""

    def __init__(self):
        self.values = {}

    def compare_set(self, key, expected, value):
        self.values.setdefault(key, value)
        return self.values[key].encode()

    def set(self, key, value):
        self.values[key] = value

    def add(self, key, amount):
        self.values[key] = int(self.values.get(key, 0)) + amount
        return self.values[key]


@pytest.fixture
def exits(monkeypatch) -> list:
    """The exit codes the record would have ended this process with."""
    codes = []
    monkeypatch.setattr(failure, "_real_exit", codes.append)
    return codes


class _Waits(threading.Event):
    """``process_ends`` that says when a thread waits on it."""

    def __init__(self):
        super().__init__()
        self.entered = threading.Event()

    def wait(self, timeout=None):
        self.entered.set()
        return super().wait(timeout)


def test_a_rank_stops_once_when_a_second_thread_sees_the_failure(exits, capsys):
    """The main thread stops for a failed collective while the heartbeat thread reads the same failure in the store:
    one line, one exit; the second thread waits for the first to end the process."""
    record = failure.FailureRecord(_FailureStore(), 1)
    record.process_ends = _Waits()
    record.stop("rank 0 raised RuntimeError: boom", failure.EXIT_CODE)
    second = threading.Thread(target=record.stop, args=("rank 0 raised RuntimeError: boom", failure.EXIT_CODE))
    second.start()
    try:
        assert record.process_ends.entered.wait(30), "the second stop did not wait for the first"
        assert second.is_alive() and exits == [failure.EXIT_CODE]
    finally:
        record.process_ends.set()  # what ending the process does to the waiting thread
        second.join()
    assert exits == [failure.EXIT_CODE]
    assert capsys.readouterr().err == "[deepspeed_xla] rank 1 stops: rank 0 raised RuntimeError: boom\n"


def test_a_signal_handler_inside_the_stop_lets_it_go_on(exits, monkeypatch, capsys):
    """SIGTERM's handler runs on the main thread between bytecodes, possibly inside its own stop: it returns, and the
    interrupted stop is the one that prints and ends the process."""
    record = failure.FailureRecord(_FailureStore(), 1)
    publish = record.publish
    monkeypatch.setattr(record, "publish", lambda failure_: (
        record.stop("rank 1 got SIGTERM", failure.TERMINATED_EXIT_CODE), publish(failure_))[1])
    record.stop("rank 0 raised RuntimeError: boom", failure.EXIT_CODE)
    assert exits == [failure.EXIT_CODE]
    assert capsys.readouterr().err == "[deepspeed_xla] rank 1 stops: rank 0 raised RuntimeError: boom\n"


def test_rank_0_lingers_before_it_exits(monkeypatch):
    """Rank 0's process hosts the store: the others read the failure from it before it goes."""
    record, order = failure.FailureRecord(_FailureStore(), 0), []
    monkeypatch.setattr(failure, "_real_exit", lambda code: order.append(("exit", code)))
    record.stop("rank 1 raised ValueError: x", failure.EXIT_CODE, lambda: order.append(("linger", None)))
    assert order == [("linger", None), ("exit", failure.EXIT_CODE)]
    assert record._store.values["stopped/0"] == "1"


def test_peers_are_told_the_first_line_of_a_raised_error(capsys):
    """An XLA error can run to pages (a TPU's largest allocations after its status line): the peers print its first
    line, the raising rank's own traceback keeps the rest."""
    record = failure.FailureRecord(_FailureStore(), 1)
    error = RuntimeError("\nRESOURCE_EXHAUSTED: out of memory\n\nLargest allocations:\n1.")
    record.publish_exception(RuntimeError, error)
    assert record._store.values[failure.FAILED] == "rank 1 raised RuntimeError: RESOURCE_EXHAUSTED: out of memory"
    assert record.raised and capsys.readouterr().err == ""


def test_a_failure_read_from_the_store_is_printed_as_one_bounded_line(exits, capsys):
    """Whoever reaches the store may write the failure every rank prints: no escape sequences, no forged lines, no
    megabytes of text."""
    store = _FailureStore()
    store.values[failure.FAILED] = "rank 3 raised \x1b[31mX\nrank 5 stops: fake" + "y" * 5000
    record = failure.FailureRecord(store, 1)
    record.stop("rank 1 sent no heartbeat", failure.EXIT_CODE)
    line = capsys.readouterr().err
    assert line.startswith("[deepspeed_xla] rank 1 stops: rank 3 raised \\x1b[31mX\\nrank 5 stops: fakeyyy"), line
    assert line.endswith(" more characters)\n") and line.count("\n") == 1 and len(line) < failure.LONGEST + 100


def test_a_rank_is_counted_once_among_the_ended_ones():
    """Rank 0 leaves, taking the store, once the count reaches the other ranks: a rank said twice would end it early."""
    store = _FailureStore()
    record = failure.FailureRecord(store, 2)
    record.mark_ended("done")
    record.mark_ended("done")
    record.mark_ended("stopped")
    assert store.values[failure.ENDED] == 1 and store.values["done/2"] == store.values["stopped/2"] == "1"
    failure.FailureRecord(store, 0).mark_ended("done")  # rank 0 waits for the others: it is not in their count
    assert store.values[failure.ENDED] == 1
