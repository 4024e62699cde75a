"""``patches/comm.py``: the comms logger records each op's own latency."""
import types

import pytest
import torch

from deepspeed_xla import patches
from deepspeed_xla.patches import comm


@pytest.fixture
def logger(monkeypatch):
    """DeepSpeed's comms logger on, profiling every op, with an empty record; the timers' clock in our hands."""
    from deepspeed.comm import comm as ds_comm
    from deepspeed.utils import timer
    clock = [100.0]
    monkeypatch.setattr(timer.time, "time", lambda: clock[0])
    monkeypatch.setattr(ds_comm.comms_logger, "enabled", True)
    monkeypatch.setattr(ds_comm.comms_logger, "prof_all", True)
    monkeypatch.setattr(ds_comm.comms_logger, "verbose", False)
    monkeypatch.setattr(ds_comm.comms_logger, "comms_dict", {})
    # The backend timed_op and the logger's bandwidth figures ask: 2 ranks, no MPI.
    monkeypatch.setattr(ds_comm, "cdb", types.SimpleNamespace(using_mpi=False, is_initialized=lambda: True,
                                                               get_world_size=lambda group=None: 2))
    return ds_comm, clock


def test_each_logged_latency_is_the_ops_own(logger):
    """An op decorated by DeepSpeed's own ``timed_op`` takes 10, 20 then 30 ms by the clock: the logger records those,
    not the running sums upstream's timers give (10, 30, 60)."""
    ds_comm, clock = logger
    (patch, ) = [p for p in patches.PATCHES if p.wrapper is comm.each_op_timed_alone]
    assert patches.is_applied(patch)

    @ds_comm.timed_op
    def all_reduce(tensor, op=None, group=None, async_op=False, prof=False, log_name="all_reduce", debug=""):
        clock[0] += durations.pop(0)

    durations = [0.010, 0.020, 0.030]
    for _ in range(3):
        all_reduce(torch.ones(256))
    ((size, (count, latencies, *_)), ) = ds_comm.comms_logger.comms_dict["all_reduce"].items()
    assert (size, count) == (1024, 3)
    assert latencies == pytest.approx([10.0, 20.0, 30.0])

    upstream = type(ds_comm.timers).__mro__[1]()  # what the logger read before the patch: the sums
    for duration in (0.010, 0.020):
        upstream("op").start()
        clock[0] += duration
        upstream("op").stop()
        last = upstream("op").elapsed(reset=False)
    assert last == pytest.approx(30.0)


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "computed"])
def test_an_xla_tensor_that_requires_grad_unpickles(xla_device, leaf):
    """What AutoTP's input check does with a batch that requires grad (``broadcast_object_list`` pickles it): the tensor
    comes back on the device, equal, requiring grad and a leaf. Upstream's rebuild, handed the same pickled copy,
    raises."""
    import inspect
    import pickle
    (patch, ) = [p for p in patches.PATCHES if p.wrapper is comm.rebuilt_xla_tensor_is_a_leaf]
    assert patches.is_applied(patch)
    source = torch.arange(6.0, device=xla_device).requires_grad_()
    sent = source if leaf else source * 2
    received = pickle.loads(pickle.dumps(sent))
    assert received.device == sent.device and received.is_leaf and received.requires_grad
    assert torch.equal(received.detach().cpu(), sent.detach().cpu())
    rebuild, args = sent.__reduce_ex__(2)
    with pytest.raises(RuntimeError, match="leaf variables"):
        inspect.unwrap(rebuild)(*args)
