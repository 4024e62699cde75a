"""What every device type says about itself as data, and the one decision of which type runs here."""
import pytest
import torch.distributed as dist

from deepspeed_xla import devices
from deepspeed_xla.comm import backends


@pytest.mark.parametrize("name", list(devices.DEVICE_TYPES))
def test_each_device_type_names_a_backend_that_registers(monkeypatch, name):
    """The device types name their backend without importing ``comm``; the name must be one it registers."""
    from deepspeed_xla.comm import staging
    monkeypatch.setattr(staging, "_zero_copy", staging.zero_copy())  # registering sets it for the process
    device_type = devices.DEVICE_TYPES[name]()
    assert device_type.comm_backend in backends.BACKENDS
    backends.register_backend(device_type.comm_backend, device_type.host_addressable)
    assert device_type.comm_backend.upper() in dist.Backend._plugins


def test_an_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="'nccl' is not a deepspeed_xla backend; use one of xla_host, xla_ds"):
        backends.register_backend("nccl", host_addressable=False)


def test_the_decision_follows_pjrt_device_and_is_reused(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "cpu")
    first = devices.current_device_type()
    assert first.pjrt_name == "CPU" and devices.current_device_type() is first
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert devices.current_device_type().pjrt_name == "TPU"
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert devices.current_device_type().pjrt_name == "CPU"
