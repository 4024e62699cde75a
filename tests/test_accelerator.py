"""XLA_Accelerator against DeepSpeed's accelerator interface, on a real PJRT CPU device."""
import inspect

import pytest
import torch

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from deepspeed_xla.accelerator import XLA_Accelerator


@pytest.fixture(scope="module")
def accel():
    return XLA_Accelerator()


def _arguments(accel, name):
    """Meaningful arguments for each abstract member, by name."""
    xla_tensor = torch.ones(3, device=accel.device())
    table = {
        "device_name": (0, ),
        "device": (0, ),
        "set_device": ("0", ),
        "set_rng_state": (accel.get_rng_state(), ),
        "manual_seed": (7, ),
        "manual_seed_all": (7, ),
        "default_generator": (0, ),
        "stream": (None, ),
        "range_push": ("region", ),
        "lazy_call": (lambda: 42, ),
        "capture_to_graph": (None, ),
        "replay_graph": (None, ),
        "on_accelerator": (xla_tensor, ),
        "create_op_builder": ("FusedAdamBuilder", ),
        "get_op_builder": ("FusedAdamBuilder", ),
        "set_visible_devices_envs": ({}, [0, 1]),
        "set_compile_backend": ("openxla", ),
        "register_host_memory": (0, 0),
        "unregister_host_memory": (0, ),
    }
    return table.get(name, ())


def test_every_abstract_member_works(accel):
    abstract = sorted(DeepSpeedAccelerator.__abstractmethods__)
    assert len(abstract) >= 60
    for name in abstract:
        member = inspect.getattr_static(XLA_Accelerator, name)
        assert getattr(member, "__isabstractmethod__", False) is False, f"{name} is not implemented"
        value = getattr(accel, name)
        if isinstance(member, property):
            continue
        try:
            value(*_arguments(accel, name))
        except NotImplementedError as exc:
            pytest.fail(f"{name} raised NotImplementedError: {exc}")


def test_device_naming(accel):
    assert accel.device_name() == "xla"
    assert accel.device_name("1") == accel.device_name(1) == "xla:0"
    assert accel.current_device_name() == "xla:0"
    assert accel.current_device() == torch.device("xla", 0)
    assert accel.device().type == "xla"
    accel.set_device(torch.device("xla", 0))


def test_tensor_factories_make_xla_tensors(accel):
    for factory, dtype in ((accel.FloatTensor, torch.float32), (accel.LongTensor, torch.int64),
                           (accel.IntTensor, torch.int32), (accel.ByteTensor, torch.uint8),
                           (accel.BFloat16Tensor, torch.bfloat16)):
        t = factory([1, 2])
        assert t.device.type == "xla" and t.dtype == dtype
        assert t.cpu().tolist() == [1, 2]


def test_seed_reaches_xla_rng(accel):
    device = accel.device()
    accel.manual_seed(123)
    first = torch.nn.functional.dropout(torch.ones(64, device=device), 0.5).cpu()
    accel.manual_seed(123)
    second = torch.nn.functional.dropout(torch.ones(64, device=device), 0.5).cpu()
    accel.manual_seed(124)
    third = torch.nn.functional.dropout(torch.ones(64, device=device), 0.5).cpu()
    assert torch.equal(first, second)
    assert not torch.equal(first, third)


def test_rng_state_round_trip(accel):
    device = accel.device()
    accel.manual_seed(5)
    state = accel.get_rng_state()
    a = torch.rand(8, device=device).cpu()
    accel.set_rng_state(state)
    b = torch.rand(8, device=device).cpu()
    assert torch.equal(a, b)
    gen = accel.default_generator(0)
    gen.set_state(state)
    assert torch.equal(torch.rand(8, device=device).cpu(), a)


def test_synchronize_materializes_pending_work(accel):
    import torch_xla
    t = torch.ones(4, device=accel.device()) * 3
    accel.synchronize()
    assert torch_xla._XLAC._get_xla_tensors_text([t]).count("xla::device_data") == 1


def test_memory_apis_never_raise_and_report_host_figures_on_cpu(accel):
    assert accel.memory_allocated() > 0
    assert accel.max_memory_allocated() >= accel.memory_allocated() > 0
    assert accel.total_memory() >= accel.available_memory() > 0
    stats = accel.memory_stats()
    assert stats.get("num_alloc_retries") == 0
    accel.reset_peak_memory_stats()
    accel.empty_cache()


def test_dtypes_and_flags(accel):
    assert accel.supported_dtypes() == [torch.float32, torch.bfloat16]
    assert accel.is_bf16_supported() and not accel.is_fp16_supported()
    assert all((accel.is_synchronized_device(), accel.use_host_timers(), accel.resolves_data_dependency(),
                accel.handles_memory_backpressure()))
    assert accel.Stream is None and accel.Event is None and accel.current_stream() is None


def test_pinning_is_a_no_op(accel):
    t = torch.ones(3)
    assert accel.pin_memory(t) is t
    assert not accel.is_pinned(t)
    assert accel.pin_empty(4, dtype=torch.float32).shape == (4, )


def test_launcher_facing_members(accel):
    env = {}
    accel.set_visible_devices_envs(env, [0, 1])
    assert env == {accel.visible_devices_envs()[0]: "0,1"}
    assert {"PJRT_", "XLA_"} <= set(accel.export_envs())
    assert accel.communication_backend_name() == "xla_host"
    assert accel.get_compile_backend() == "openxla"
    with pytest.raises(ValueError, match="openxla"):
        accel.set_compile_backend("no-such-backend")


def test_op_builders(accel):
    from deepspeed_xla.op_builder import FusedAdamBuilder, NotImplementedBuilder
    assert accel.get_op_builder("FusedAdamBuilder") is FusedAdamBuilder
    assert accel.get_op_builder("TransformerBuilder") is NotImplementedBuilder
    assert accel.get_op_builder("NotImplementedBuilder") is NotImplementedBuilder
    assert accel.create_op_builder("ShareMemCommBuilder") is None
    assert not NotImplementedBuilder().is_compatible()
    with pytest.raises(ValueError, match="no XLA implementation"):
        NotImplementedBuilder().load()
