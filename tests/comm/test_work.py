"""``comm/work.py``: the queue of issued collectives runs them in order; one that fails leaves the ones it stopped
failing too, never returning stale outputs."""
import pytest
import torch

from deepspeed_xla.comm import work


class _Group:
    """Stands in for the host-staged group: each call adds 1 to its output, or raises on the input ``fail_on``; the
    members disagree on the op whose signature is ``disagree_on``."""

    def __init__(self, fail_on: float = None, disagree_on: str = None):
        self.fail_on, self.disagree_on, self.calls, self.announced = fail_on, disagree_on, [], []

    def announce(self, signatures):
        self.announced.append(list(signatures))

    def wait_in(self, signature):
        return None  # what a hang report would name: no watchdog here

    def agree(self, signature):
        if signature == self.disagree_on:
            raise RuntimeError(f"the ranks of a group passed {signature} different tensors")

    def _launch(self, inputs, host_in, outputs, call, in_place):
        self.calls.append(float(host_in[0]))
        if float(host_in[0]) == self.fail_on:
            raise MemoryError("device out of memory while staging")
        outputs[0].copy_(host_in[0] + 1)
        return work.completed_work()


def _issue(group, value: float) -> "work.PendingWork":
    pending = work.PendingWork(group, [torch.tensor(value)], [torch.zeros(())], call=None, in_place=False,
                               signature=f"op {value}")
    work.ISSUED.add(pending)
    return pending


def test_waiting_on_the_last_runs_everything_issued_in_order():
    group = _Group()
    first, second = _issue(group, 1.0), _issue(group, 2.0)
    second.wait()
    assert group.calls == [1.0, 2.0] and float(first.outputs[0]) == 2.0 and float(second.outputs[0]) == 3.0
    assert first.wait() and group.calls == [1.0, 2.0]


def test_ops_stopped_by_a_failure_raise_instead_of_returning_stale_outputs():
    group = _Group(fail_on=2.0)
    first, failing, later = _issue(group, 1.0), _issue(group, 2.0), _issue(group, 3.0)
    with pytest.raises(MemoryError):
        later.wait()
    assert first.wait() and float(first.outputs[0]) == 2.0
    for stopped in (failing, later):
        with pytest.raises(RuntimeError, match="never ran: .*MemoryError: device out of memory") as raised:
            stopped.wait()
        assert isinstance(raised.value.__cause__, MemoryError)
        with pytest.raises(RuntimeError, match="never ran"):
            stopped.get_future()
    assert group.calls == [1.0, 2.0], "an op after the failure ran"
    assert not work.ISSUED.ops


def test_each_group_announces_its_ops_of_a_run_at_once_and_a_disagreement_stops_the_queue():
    """One message of signatures per group and run (``agreement``); an op the ranks disagree on never reaches gloo,
    and neither do the ones after it."""
    group, other = _Group(disagree_on="op 3.0"), _Group()
    ops = [_issue(group, 1.0), _issue(other, 2.0), _issue(group, 3.0), _issue(other, 4.0)]
    with pytest.raises(RuntimeError, match="passed op 3.0 different tensors"):
        ops[-1].wait()
    assert group.announced == [["op 1.0", "op 3.0"]] and other.announced == [["op 2.0", "op 4.0"]]
    assert group.calls == [1.0] and other.calls == [2.0]
    with pytest.raises(RuntimeError, match=r"never ran: .*\(RuntimeError: the ranks of a group passed op 3.0"):
        ops[3].wait()


class _GlooWork:
    """Stands in for a gloo Work that finishes when told to."""

    def __init__(self):
        self.finished = False

    def is_completed(self) -> bool:
        return self.finished

    def wait(self) -> bool:
        self.finished = True
        return True


def test_host_work_is_completed_without_blocking_and_writes_its_results_once_done():
    """What isend/irecv return: polling ``is_completed`` must neither block nor report an op whose results are not
    in its tensors yet."""
    gloo, target, received = _GlooWork(), torch.zeros(3), torch.arange(3.0)
    pending = work.HostWork(gloo, [target], [received])
    assert not pending.is_completed() and not target.any() and not gloo.finished
    gloo.finished = True
    assert pending.is_completed() and torch.equal(target, received)


def test_host_work_future_holds_the_outputs():
    target, received = torch.zeros(2), torch.ones(2)
    future = work.HostWork([_GlooWork()], [target], [received]).get_future()
    assert future.done() and future.value()[0] is target and torch.equal(target, received)
