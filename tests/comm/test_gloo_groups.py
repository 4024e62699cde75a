"""``comm/gloo_groups.py``: which backend specs name gloo, and a gloo default group made too early."""
import pytest
import torch.distributed as dist

from deepspeed_xla.comm import gloo_groups


@pytest.mark.parametrize("spec, gloo", [("gloo", True), ("GLOO", True), ("cpu:gloo", True),
                                        ("cpu:gloo,cuda:nccl", True), ("xla_host", False), ("nccl", False),
                                        ("cuda:nccl", False), ("xla_ds", False)])
def test_which_specs_name_gloo(spec, gloo):
    assert gloo_groups._names_gloo(spec) is gloo


def test_gloo_default_group_made_before_registration_names_the_call(monkeypatch):
    """Handed every collective of DeepSpeed, a plain gloo default group would read no XLA data.

    torch's own group factory for this test: another test of this process may have registered the backend, after
    which gloo groups are xla_host groups."""
    from torch.distributed import distributed_c10d
    helper = distributed_c10d._new_process_group_helper
    monkeypatch.setattr(distributed_c10d, "_new_process_group_helper", getattr(helper, "__wrapped__", helper))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match=r"default group is 'gloo': init_process_group\(\) ran before "
                                               r"deepspeed.init_distributed\(\)"):
            gloo_groups.install("xla_host")
    finally:
        dist.destroy_process_group()


def test_the_wrapped_torch_factory_takes_the_backend_fourth():
    """``install`` wraps torch's private ``_new_process_group_helper`` and reads its 4th argument as the backend,
    as torch 2.9 (the pinned release) passes it: fail here, not silently, when torch moves it."""
    import inspect
    from torch.distributed import distributed_c10d
    helper = inspect.unwrap(distributed_c10d._new_process_group_helper)
    assert list(inspect.signature(helper).parameters)[:4] == ["group_size", "group_rank", "global_ranks_in_group",
                                                             "backend"]
