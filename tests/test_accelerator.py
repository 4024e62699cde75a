"""XLA_Accelerator against DeepSpeed's accelerator interface, on a real PJRT CPU device."""
import importlib
import inspect
import json
import os

import pytest
import torch
from torch.utils.cpp_extension import BuildExtension

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from deepspeed_xla import xla_runtime
from deepspeed_xla.accelerator import XLA_Accelerator, _seed_to_state
from deepspeed_xla.op_builder import FusedAdamBuilder
from deepspeed_xla.process_env import launch_environment
from tests.multiproc import run_python


@pytest.fixture(scope="module")
def accel():
    return XLA_Accelerator()


def _is_context_manager(value) -> bool:
    with value:
        return True


def _xla_tensor_factory(dtype):
    return lambda factory, accel: ((t := factory([1, 2])).device.type, t.dtype, t.cpu().tolist()) == ("xla", dtype,
                                                                                                       [1, 2])


def _seed_set(seed):
    return lambda result, accel: (result is None and torch.initial_seed() == seed
                                  and int.from_bytes(bytes(accel.get_rng_state().tolist()), "little") == seed)


def _peak_of(figure: str):
    """A peak's check: positive, and at least every reading of ``figure`` taken before it (host memory on PJRT CPU
    may grow between two calls, so a reading after the peak may exceed it)."""
    def check(result, accel):
        peak = getattr(accel, f"max_{figure}")
        return 0 < result <= peak() and getattr(accel, figure)() <= peak()
    return check


# Every abstract member of DeepSpeed's accelerator interface: (arguments, or a function of the accelerator giving
# them; what the result must satisfy). Details of several are tested below; here each member must give a result
# DeepSpeed can use, not only "not raise".
MEMBERS = {
    "BFloat16Tensor": ((), _xla_tensor_factory(torch.bfloat16)),
    "ByteTensor": ((), _xla_tensor_factory(torch.uint8)),
    "DoubleTensor": ((), _xla_tensor_factory(torch.float64)),
    "FloatTensor": ((), _xla_tensor_factory(torch.float32)),
    "HalfTensor": ((), _xla_tensor_factory(torch.float16)),
    "IntTensor": ((), _xla_tensor_factory(torch.int32)),
    "LongTensor": ((), _xla_tensor_factory(torch.int64)),
    "Event": ((), lambda result, accel: result is None),
    "Stream": ((), lambda result, accel: result is None),
    "available_memory": ((), lambda result, accel: 0 < result <= accel.total_memory()),
    "build_extension": ((), lambda result, accel: result is BuildExtension),
    "capture_to_graph": ((None, ), lambda result, accel: _is_context_manager(result)),
    "communication_backend_name": ((), lambda result, accel: result == "xla_host"),
    "create_graph": ((), lambda result, accel: result is None),
    "create_op_builder": (("FusedAdamBuilder", ), lambda result, accel: isinstance(result, FusedAdamBuilder)),
    "current_device": ((), lambda result, accel: result == torch.device("xla", 0)),
    "current_device_name": ((), lambda result, accel: result == "xla:0"),
    "current_stream": ((), lambda result, accel: result is None),
    "default_generator": ((0, ), lambda result, accel: torch.equal(result.get_state(), accel.get_rng_state())),
    "default_stream": ((), lambda result, accel: result is None),
    "device": ((0, ), lambda result, accel: result == torch.device("xla", 0)),
    # This process runs one device of the host's (the runtime's count); the accelerator counts the host's, as the
    # launch environment gives them (tests/test_process_env.py: what a parent counts after taking one).
    "device_count": ((), lambda result, accel: result == int(
        launch_environment().get("CPU_NUM_DEVICES") or len(os.sched_getaffinity(0))) >=
        xla_runtime.xr().addressable_runtime_device_count() == 1),
    "device_name": ((0, ), lambda result, accel: result == "xla:0"),
    "empty_cache": ((), lambda result, accel: result is None),
    "export_envs": ((), lambda result, accel: {"PJRT_", "XLA_"} <= set(result)),
    "get_compile_backend": ((), lambda result, accel: result == "openxla"),
    "get_op_builder": (("FusedAdamBuilder", ), lambda result, accel: result is FusedAdamBuilder),
    "get_rng_state": ((), lambda result, accel: result.dtype == torch.uint8 and result.shape == (8, )),
    "handles_memory_backpressure": ((), lambda result, accel: result is True),
    "initial_seed": ((), lambda result, accel: result == torch.initial_seed()),
    "is_available": ((), lambda result, accel: result is True),
    "is_bf16_supported": ((), lambda result, accel: result is True),
    "is_fp16_supported": ((), lambda result, accel: result is False),
    "is_synchronized_device": ((), lambda result, accel: result is True),
    "is_triton_supported": ((), lambda result, accel: result is False),
    "lazy_call": ((lambda: 42, ), lambda result, accel: result == 42),
    "manual_seed": ((7, ), _seed_set(7)),
    "manual_seed_all": ((8, ), _seed_set(8)),
    "max_memory_allocated": ((), _peak_of("memory_allocated")),
    "max_memory_cached": ((), _peak_of("memory_cached")),
    "max_memory_reserved": ((), _peak_of("memory_reserved")),
    "memory_allocated": ((), lambda result, accel: isinstance(result, int) and result > 0),
    "memory_cached": ((), lambda result, accel: isinstance(result, int) and result > 0),
    "memory_reserved": ((), lambda result, accel: isinstance(result, int) and result > 0),
    "memory_stats": ((), lambda result, accel: result["num_alloc_retries"] == 0
                     and result["allocated_bytes.all.peak"] >= result["allocated_bytes.all.current"] > 0),
    "on_accelerator": (lambda accel: (torch.ones(1, device=accel.device()), ),
                       lambda result, accel: result is True and accel.on_accelerator(torch.ones(1)) is False),
    "op_builder_dir": ((), lambda result, accel: importlib.import_module(result).FusedAdamBuilder is FusedAdamBuilder),
    "random": ((), lambda result, accel: result is torch.random),
    "range_pop": ((), lambda result, accel: result is None),
    "range_push": (("region", ), lambda result, accel: result is None),
    "replay_graph": ((None, ), lambda result, accel: result is None),
    "reset_max_memory_allocated": ((), lambda result, accel: result is None),
    "reset_max_memory_cached": ((), lambda result, accel: result is None),
    "reset_peak_memory_stats": ((), lambda result, accel: result is None),
    "resolves_data_dependency": ((), lambda result, accel: result is True),
    "set_compile_backend": (("openxla", ), lambda result, accel: result is None and accel.get_compile_backend() == "openxla"),
    "set_device": (("0", ), lambda result, accel: result is None and accel.current_device_name() == "xla:0"),
    "set_rng_state": ((_seed_to_state(99), ),
                      lambda result, accel: result is None and torch.equal(accel.get_rng_state(), _seed_to_state(99))),
    "set_visible_devices_envs": (({}, [0, 1]), lambda result, accel: result is None),
    "stream": ((None, ), lambda result, accel: _is_context_manager(result)),
    "supported_dtypes": ((), lambda result, accel: result == [torch.float32, torch.bfloat16]),
    "synchronize": ((), lambda result, accel: result is None),
    "total_memory": ((), lambda result, accel: result >= accel.available_memory() > 0),
    "use_host_timers": ((), lambda result, accel: result is True),
    "visible_devices_envs": ((), lambda result, accel: isinstance(result, list) and len(result) == 1
                             and isinstance(result[0], str)),
}


def test_every_abstract_member_works(accel, launch_env):  # the backend's rank variables
    """Each member of DeepSpeed's interface is implemented and returns what DeepSpeed expects of it."""
    abstract = sorted(DeepSpeedAccelerator.__abstractmethods__)
    assert len(abstract) >= 60
    assert sorted(MEMBERS) == abstract, "MEMBERS must list exactly DeepSpeed's abstract members"
    for name in abstract:
        member = inspect.getattr_static(XLA_Accelerator, name)
        assert getattr(member, "__isabstractmethod__", False) is False, f"{name} is not implemented"
        arguments, check = MEMBERS[name]
        value = getattr(accel, name)
        if callable(arguments):
            arguments = arguments(accel)
        result = value if isinstance(member, property) else value(*arguments)
        assert check(result, accel), f"{name}{arguments} returned {result!r}"


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
    assert 0 < accel.memory_allocated() <= accel.max_memory_allocated()
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


def test_launcher_facing_members(accel, launch_env):
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


def test_importing_deepspeed_leaves_the_launcher_variables_to_the_process_that_joins_a_job(monkeypatch):
    """A parent that imports deepspeed and then starts ranks (mp.spawn) must not hand them a one-rank world: the
    variables are filled in where DeepSpeed's init_distributed starts, by the process that trains."""
    import types

    from deepspeed_xla import registration
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "placeholder")  # so that monkeypatch removes what the fill sets
        monkeypatch.delenv(name)
    module = types.SimpleNamespace(SUPPORTED_ACCELERATOR_LIST=[], ds_accelerator=None)
    registration.on_real_accelerator_loaded(module)
    assert isinstance(module.ds_accelerator, XLA_Accelerator) and "RANK" not in os.environ
    module.ds_accelerator.communication_backend_name()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")


# The first line of a fresh process that is no DeepSpeed rank (plain python, as a pytest process is): the answer of a
# device-naming member goes straight to torch, as users write it and as DeepSpeed's own tests do (``param.to(
# get_accelerator().device_name(), dtype=torch.half)``). ``import deepspeed`` alone must not import torch_xla.
FIRST_DEVICE_USE = """
import json, sys, torch, deepspeed
from deepspeed.accelerator import get_accelerator
imported_with_deepspeed = "torch_xla" in sys.modules
device = get_accelerator().{call}
moved = torch.arange(3.0).to(device)
half = torch.nn.Parameter(torch.ones(2)).to(device, dtype=torch.half)
print(json.dumps({{"imported_with_deepspeed": imported_with_deepspeed, "device": str(moved.device),
                  "values": moved.cpu().tolist(), "half": [str(half.device), str(half.dtype)]}}))
"""


@pytest.mark.parametrize("call", ["device_name()", "device_name(0)", "current_device_name()", "device()",
                                  "current_device()"])
def test_device_members_work_as_the_first_device_use(call):
    proc = run_python(FIRST_DEVICE_USE.format(call=call), DS_ACCELERATOR="xla")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"imported_with_deepspeed": False, "device": "xla:0",
                                                        "values": [0.0, 1.0, 2.0], "half": ["xla:0", "torch.float16"]}


DATA_WORKER = """
import sys, torch, deepspeed
from deepspeed.accelerator import get_accelerator

class OnDevice(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        return torch.full((2, ), float(index)).to(get_accelerator().device_name()).sum().cpu()

loader = torch.utils.data.DataLoader(OnDevice(), num_workers=1, multiprocessing_context="fork")
print([float(item) for item in loader], "torch_xla" in sys.modules)
"""


def test_a_data_worker_uses_the_device_name_first():
    """A DataLoader worker forked from a process that never used the device names it and moves a tensor there."""
    proc = run_python(DATA_WORKER, DS_ACCELERATOR="xla")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "[0.0, 2.0] False"


@pytest.mark.parametrize("program", ["deepspeed", os.path.join("deepspeed", "launcher", "launch.py")])
def test_launchers_name_the_device_without_importing_torch_xla(tmp_path, program):
    """The runner (whose MVAPICH launch asks ``device_name()``) and ``launch.py`` must leave the TPU chips alone."""
    code = ("import sys\nsys.argv[0] = sys.argv[1]\nimport deepspeed\nfrom deepspeed.accelerator import get_accelerator\n"
            "print(get_accelerator().device_name(), 'torch_xla' in sys.modules)\n")
    proc = run_python(code, program, cwd=tmp_path, DS_ACCELERATOR="xla")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "xla False"
