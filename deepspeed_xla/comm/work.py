"""The Work objects of the host-staged process group, and the queue of collectives issued but not run.

A collective runs when its Work is waited on (at once for a blocking call), together with every
collective issued before it: every rank issues them in the same order, so running them in that order
keeps each group's sequence, and their XLA operands are staged together in one execution (ZeRO-3
issues one asynchronous all-gather per parameter and waits on them all).
"""
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from deepspeed_xla.comm import staging, watchdog


def completed_work(result=None) -> dist.Work:
    """A finished ``dist.Work``: our process groups complete collectives before returning."""
    future = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)


def _each(works) -> Sequence[dist.Work]:
    """A gloo call's Work, or its list of them (one per bucket or peer), as a list."""
    return works if isinstance(works, (list, tuple)) else [works]


def wait_all(works) -> None:
    try:
        with watchdog.waiting():
            for work in _each(works):
                work.wait()
    except RuntimeError as error:  # gloo: a peer closed the connection, or the timeout passed
        watchdog.explain_failure(error)


def alias_key(tensor: torch.Tensor) -> int:
    """Tensors with the same key may share memory: a view is keyed by its base."""
    return id(tensor._base if tensor._base is not None else tensor)


class Issued:
    """Collectives issued and not yet run, in issue order, over all groups of this process."""

    def __init__(self):
        self.ops: List["PendingWork"] = []
        self.read, self.written = set(), set()

    def _run_if_any(self, tensors: Sequence[torch.Tensor], keys: set) -> None:
        if any(alias_key(t) in keys for t in tensors):
            self.run()

    def add(self, work: "PendingWork") -> None:
        """Queue ``work``. Queued ops stage all their inputs before any writes back, so only an op that
        reads what a queued op writes must wait for the queue to run."""
        self._run_if_any(work.inputs, self.written)
        self.ops.append(work)
        self.read.update(alias_key(t) for t in work.inputs)
        self.written.update(alias_key(t) for t in work.outputs)

    def before_now(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Before an op that runs at once: run the queue if the op reads what it writes, or writes what it
        reads or writes (issued later, the op must see the queue's results and not change its inputs)."""
        self._run_if_any(inputs, self.written)
        self._run_if_any(outputs, self.read | self.written)

    def run(self) -> None:
        """Tell each group's peers what its ops pass (``agreement``), stage every queued op's operands at once, then
        run the ops in order. If staging or an op raises, the ops that did not run keep the error: waiting on one of
        them raises it instead of returning its stale outputs."""
        ops, self.ops, self.read, self.written = self.ops, [], set(), set()
        try:
            for group in dict.fromkeys(op.group for op in ops):
                signatures = [op.signature for op in ops if op.group is group]
                with watchdog.in_collective(group.wait_in(signatures[0])):
                    group.announce(signatures)
            staged = iter(staging.to_host([t for op in ops for t in op.inputs]))
            for op in ops:
                with watchdog.in_collective(op.group.wait_in(op.signature)):
                    op.run([next(staged) for _ in op.inputs])
        except BaseException as error:
            for op in ops:
                if not op.done:
                    op.error = error
            raise


ISSUED = Issued()


class PendingWork(dist.Work):
    """A collective queued in ``ISSUED``: waiting on it runs it and everything issued before it."""

    def __init__(self, group: dist.ProcessGroup, inputs, outputs, call: Callable, in_place: bool, signature: str):
        """``group``: the host-staged group whose ``_launch`` runs ``call``; ``signature``: what every member of the
        group passes this collective (``agreement.signature``)."""
        super().__init__()
        self.group, self.inputs, self.outputs, self.call = group, list(inputs), list(outputs), call
        self.in_place, self.done, self.signature = in_place, False, signature
        self.error: Optional[BaseException] = None  # what stopped the queue before this op ran

    def run(self, host_in: List[torch.Tensor]) -> None:
        self.group.agree(self.signature)
        self.group._launch(self.inputs, host_in, self.outputs, self.call, self.in_place).wait()
        self.done = True

    def _finish(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"deepspeed_xla: this collective never ran: an error stopped the collectives issued "
                               f"with it ({type(self.error).__name__}: {self.error})") from self.error
        if not self.done:
            ISSUED.run()

    def wait(self, timeout=None) -> bool:
        self._finish()
        return True

    def is_completed(self) -> bool:
        self._finish()
        return True

    def result(self) -> List[torch.Tensor]:
        self._finish()
        return self.outputs

    def get_future(self) -> torch.futures.Future:
        self._finish()
        future = torch.futures.Future()
        future.set_result(self.outputs)
        return future


class HostWork(dist.Work):
    """A gloo op on host buffers; ``wait`` finishes it and writes the results into the XLA tensors. ``collective``:
    what its wait is in, when not the collective running it (a send or receive, waited on by the caller)."""

    def __init__(self, works, outputs: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor], collective=None):
        super().__init__()
        self._works, self._outputs, self._hosts, self._collective = works, list(outputs), list(hosts), collective

    def wait(self, timeout=None) -> bool:
        """``timeout`` is the group's, as gloo applies it."""
        with watchdog.in_collective(self._collective):
            wait_all(self._works)
        staging.write_back(self._outputs, self._hosts)
        self._outputs = self._hosts = []
        return True

    def is_completed(self) -> bool:
        """Whether gloo has finished, without blocking; a finished op has written its results, as after ``wait``."""
        if not all(work.is_completed() for work in _each(self._works)):
            return False
        return self.wait()

    def get_future(self) -> torch.futures.Future:
        """Completed at once (the op is waited on): its result is the op's output tensors."""
        outputs = self._outputs
        self.wait()
        future = torch.futures.Future()
        future.set_result(outputs)
        return future

    def _source_rank(self) -> int:
        return self._works._source_rank()
