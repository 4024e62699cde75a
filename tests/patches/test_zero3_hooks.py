"""``patches/zero3_hooks.py``: ZeRO-3's hooks do the same with less Python."""
import pytest

from deepspeed_xla import patches
from deepspeed_xla.patches import zero3_hooks


@pytest.fixture
def rank_queries(monkeypatch):
    """Counts ``deepspeed.comm.get_rank`` calls; this process is rank 0."""
    from deepspeed import comm
    calls = []
    monkeypatch.setattr(comm, "get_rank", lambda *args, **kwargs: calls.append(args) or 0)
    return calls


def test_print_rank_0_asks_for_the_rank_only_when_it_prints(rank_queries, capsys):
    """ZeRO-3's gathers and releases (partitioned_param_coordinator, parameter_offload: their ``import *`` takes the
    patched function) call print_rank_0 with ``force=False``: no rank query and nothing printed; forced, rank 0 prints
    as upstream does."""
    import deepspeed.runtime.zero.parameter_offload as offload
    import deepspeed.runtime.zero.partition_parameters as partition
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    (patch,) = [p for p in patches.PATCHES if p.wrapper is zero3_hooks.print_rank_0_when_asked]
    assert patches.is_applied(patch)
    assert coordinator.print_rank_0 is partition.print_rank_0 is offload.print_rank_0
    for print_rank_0 in (partition.print_rank_0, coordinator.print_rank_0):
        print_rank_0("released", force=False)
    assert rank_queries == [] and capsys.readouterr().out == ""
    partition.print_rank_0("forced", force=True)
    partition.print_rank_0("debug", debug=True)
    assert len(rank_queries) == 2 and capsys.readouterr().out == "forced\ndebug\n"
    upstream = partition.print_rank_0.__wrapped__  # upstream's asks every time
    upstream("released", force=False)
    assert len(rank_queries) == 3
