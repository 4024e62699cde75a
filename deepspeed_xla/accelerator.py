"""``XLA_Accelerator``: DeepSpeed's accelerator abstraction on an XLA device.

XLA is a lazy, synchronized device to DeepSpeed: no streams or events, host timers, and every
DeepSpeed index maps to this process's one device (``xla:0``) since each process drives one device.
The constructor runs in the ``deepspeed`` launcher too, so it imports neither torch_xla nor heavy
DeepSpeed modules and never starts the XLA runtime; the first device use runs
``process_setup.setup_process()``. The device type is decided once (``devices.current_device_type``)
and handed down from here: to the process setup, the comm backend and the memory and dtype answers.
"""
import functools
import os
import sys

import torch
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

from deepspeed_xla import env_vars, xla_runtime
from deepspeed_xla.comm import backends
from deepspeed_xla.devices import DeviceType, current_device_type
from deepspeed_xla.launch_env import check_launch_env, fill_single_process_env, is_deepspeed_runner, is_launcher_process
from deepspeed_xla.process_env import for_this_process, launch_environment
from deepspeed_xla.process_setup import (check_host_launch, is_prepared, prepare_process, process_count_problem,
                                         setup_process)

_DEVICE_INDEX = 0


class _XlaGenerator:
    """``default_generator(i)`` stand-in: XLA's RNG state is one integer seed, kept as 8 bytes."""

    def get_state(self) -> torch.Tensor:
        return _seed_to_state(xla_runtime.get_seed())

    def set_state(self, state: torch.Tensor) -> None:
        xla_runtime.set_seed(_state_to_seed(state))

    def manual_seed(self, seed: int) -> "_XlaGenerator":
        xla_runtime.set_seed(seed)
        return self

    def initial_seed(self) -> int:
        return torch.initial_seed()


def _seed_to_state(seed: int) -> torch.Tensor:
    return torch.tensor(list(int(seed).to_bytes(8, "little", signed=False)), dtype=torch.uint8, device="cpu")


def _state_to_seed(state) -> int:
    if isinstance(state, int):
        return state
    return int.from_bytes(bytes(state.to(torch.uint8).tolist()), "little", signed=False)


class XLA_Accelerator(DeepSpeedAccelerator):

    def __init__(self):
        self._name = "xla"
        self._communication_backend_name = None
        self._compile_backend = "openxla"
        self._generator = _XlaGenerator()
        self._peak_host_bytes = 0

    @property
    def device_type(self) -> DeviceType:
        """This process's device type (``PJRT_DEVICE``): every device-type difference is asked of it."""
        return current_device_type()

    # Lazy-device flags: XLA orders work itself, DeepSpeed must not build streams or events.
    def is_synchronized_device(self):
        return True

    def use_host_timers(self):
        return True

    def resolves_data_dependency(self):
        return True

    def handles_memory_backpressure(self):
        return True

    # Device
    def device_name(self, device_index=None):
        """Bare ``'xla'`` names the device type (autocast, support checks); an index names our device.

        ``'xla'`` is a device torch accepts only once torch_xla is imported, and users and DeepSpeed's tests write
        ``.to(get_accelerator().device_name())`` as their first device use: the first call prepares this process
        (imports torch_xla with its topology set; the runtime starts at the first tensor). Not in the launchers,
        which must never import torch_xla, nor while ``import deepspeed`` runs (it asks three times for
        defaults): a process that only imports deepspeed, such as ``ds_xla_report``, stays free of torch_xla."""
        if not is_prepared() and not is_launcher_process() and not _deepspeed_importing():
            prepare_process(self.device_type)
        if device_index is None:
            return "xla"
        return self.current_device_name()

    def device(self, device_index=None):
        setup_process(self.device_type)
        return xla_runtime.device(_DEVICE_INDEX)

    def set_device(self, device_index):
        setup_process(self.device_type)

    def current_device(self):
        setup_process(self.device_type)
        return xla_runtime.device(_DEVICE_INDEX)

    def current_device_name(self):
        setup_process(self.device_type)  # the name is about to become a device (``.to(name)``, ``torch.empty``)
        return f"xla:{_DEVICE_INDEX}"

    def device_count(self):
        """Devices on this host, also after this process took one (``process_env``); in a launched worker the
        processes started here (``LOCAL_SIZE``).

        Never starts PJRT: the ``deepspeed`` runner calls this to decide how many processes to start, and
        stops on none with "no GPU resources available"; here the runner says what is missing instead.
        """
        count = (env_vars.positive_int(os.environ, "LOCAL_SIZE") or
                 self.device_type.local_device_count(launch_environment()))
        if count == 0 and is_deepspeed_runner():
            raise RuntimeError(f"deepspeed_xla: {process_count_problem(self.device_type, 1)}")
        return count

    def synchronize(self, device_index=None):
        """Every collective issued and all device work done: queued collectives run, then the pending graph."""
        backends.run_issued()
        if xla_runtime.is_runtime_initialized():
            xla_runtime.sync(wait=True)

    # RNG: torch's CPU generator and XLA's seed move together.
    def random(self):
        return torch.random

    def set_rng_state(self, new_state, device_index=None):
        self._generator.set_state(new_state)

    def get_rng_state(self, device_index=None):
        return self._generator.get_state()

    def manual_seed(self, seed):
        torch.manual_seed(seed)
        setup_process(self.device_type)
        self._generator.manual_seed(seed)

    def manual_seed_all(self, seed):
        self.manual_seed(seed)

    def initial_seed(self):
        return torch.initial_seed()

    def default_generator(self, device_index):
        return self._generator

    # Streams and events: none on a synchronized device.
    @property
    def Stream(self):
        return None

    def stream(self, stream):
        from deepspeed.runtime.utils import noop_context
        return noop_context()

    def current_stream(self, device_index=None):
        return None

    def default_stream(self, device_index=None):
        return None

    @property
    def Event(self):
        return None

    # Memory: the runtime's figures where it has them (TPU), host figures otherwise (PJRT CPU).
    def _memory(self):
        info = None
        if xla_runtime.is_runtime_initialized():
            info = self.device_type.memory_info(self.current_device())
        if info is None:
            import psutil
            used = psutil.Process().memory_info().rss
            self._peak_host_bytes = max(self._peak_host_bytes, used)
            vm = psutil.virtual_memory()
            return {"bytes_used": used, "bytes_limit": vm.total, "peak_bytes_used": self._peak_host_bytes,
                    "bytes_available": vm.available}
        info.setdefault("peak_bytes_used", info.get("bytes_used", 0))
        info["bytes_available"] = max(info.get("bytes_limit", 0) - info.get("bytes_used", 0), 0)
        return info

    def empty_cache(self):
        return None

    def memory_allocated(self, device_index=None):
        return self._memory()["bytes_used"]

    def max_memory_allocated(self, device_index=None):
        return self._memory()["peak_bytes_used"]

    def reset_max_memory_allocated(self, device_index=None):
        self._peak_host_bytes = 0

    def memory_cached(self, device_index=None):
        return self.memory_allocated()

    def max_memory_cached(self, device_index=None):
        return self.max_memory_allocated()

    def reset_max_memory_cached(self, device_index=None):
        self.reset_max_memory_allocated()

    def memory_stats(self, device_index=None):
        info = self._memory()
        return {
            "allocated_bytes.all.current": info["bytes_used"],
            "allocated_bytes.all.peak": info["peak_bytes_used"],
            "reserved_bytes.all.current": info["bytes_used"],
            "num_alloc_retries": 0,
        }

    def reset_peak_memory_stats(self, device_index=None):
        self.reset_max_memory_allocated()

    def memory_reserved(self, device_index=None):
        return self.memory_allocated()

    def max_memory_reserved(self, device_index=None):
        return self.max_memory_allocated()

    def total_memory(self, device_index=None):
        return self._memory()["bytes_limit"]

    def available_memory(self, device_index=None):
        return self._memory()["bytes_available"]

    # Data types
    def is_bf16_supported(self):
        return self.device_type.is_bf16_supported()

    def is_fp16_supported(self):
        return self.device_type.is_fp16_supported()

    def is_fp64_supported(self):
        return self.device_type.is_fp64_supported()

    def supported_dtypes(self):
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    # Misc
    def is_available(self):
        try:
            return self.device_count() > 0
        except (ImportError, OSError, ValueError):
            return False

    def range_push(self, msg, domain=None, category=None):
        return None

    def range_pop(self, domain=None):
        return None

    def lazy_call(self, callback):
        return callback()

    def communication_backend_name(self):
        """Registers the backend with torch.distributed on first use, which is the start of DeepSpeed's
        ``init_distributed``. A process without a launcher becomes rank 0 of 1 here, not at ``import deepspeed``,
        and for itself alone (``process_env``): the ranks a parent spawns get no one-rank world from it."""
        with for_this_process():
            fill_single_process_env(os.environ)
        check_launch_env()
        if self._communication_backend_name is None:
            device_type = self.device_type
            self._communication_backend_name = backends.register_backend(device_type.comm_backend,
                                                                         device_type.host_addressable)
        return self._communication_backend_name

    def is_triton_supported(self):
        return False

    # Graphs: XLA compiles and caches graphs itself.
    def create_graph(self):
        return None

    def capture_to_graph(self, graph, pool=None, stream=None):
        from deepspeed.runtime.utils import noop_context
        return noop_context()

    def replay_graph(self, graph):
        return None

    # Tensor factories (DeepSpeed calls them, e.g. ``FloatTensor([x])``) make tensors on this device.
    def _factory(self, dtype):
        return functools.partial(_tensor_on_device, dtype=dtype)

    @property
    def BFloat16Tensor(self):
        return self._factory(torch.bfloat16)

    @property
    def ByteTensor(self):
        return self._factory(torch.uint8)

    @property
    def DoubleTensor(self):
        return self._factory(torch.float64)

    @property
    def FloatTensor(self):
        return self._factory(torch.float32)

    @property
    def HalfTensor(self):
        return self._factory(torch.float16)

    @property
    def IntTensor(self):
        return self._factory(torch.int32)

    @property
    def LongTensor(self):
        return self._factory(torch.int64)

    # Pinning: XLA hosts need no page-locked staging, and pin_memory() raises without a GPU.
    _torch_pins_host_memory = False

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        return tensor

    def _torch_pin_memory(self, tensor):
        return tensor

    def _torch_empty_pinned(self, tensor, shape):
        return tensor.new_empty(shape)

    def _torch_is_pinned(self, tensor):
        return False

    def is_pinned(self, tensor):
        return False

    def on_accelerator(self, tensor):
        return tensor.device.type == "xla"

    # Op builders
    def op_builder_dir(self):
        return "deepspeed_xla.op_builder"

    def create_op_builder(self, class_name):
        from deepspeed_xla.op_builder import create_op_builder
        return create_op_builder(class_name)

    def get_op_builder(self, class_name):
        from deepspeed_xla.op_builder import get_op_builder
        return get_op_builder(class_name)

    def build_extension(self):
        from torch.utils.cpp_extension import BuildExtension
        return BuildExtension

    # Launcher
    def export_envs(self):
        return self.device_type.export_env_prefixes()

    def visible_devices_envs(self):
        return [self.device_type.visible_devices_env]

    def set_visible_devices_envs(self, current_env, local_accelerator_ids):
        """``launch.py`` calls this once per host, with the ids of the workers it is about to start; there it
        checks the host first (a worker's own device count says nothing about the host)."""
        if is_launcher_process():
            check_host_launch(self.device_type, local_accelerator_ids)
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(map(str, local_accelerator_ids))

    # Compile
    def get_compile_backend(self):
        return self._compile_backend

    def set_compile_backend(self, backend):
        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(f"{backend} is not a torch.compile backend; on XLA use 'openxla' "
                             f"(available: {supported}).")
        self._compile_backend = backend


def _deepspeed_importing() -> bool:
    """Whether ``import deepspeed`` is still running in this process (importlib's flag for a partially initialized
    module, the one behind its "partially initialized module" error)."""
    module = sys.modules.get("deepspeed")
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _tensor_on_device(data, dtype):
    setup_process()
    return torch.tensor(data, dtype=dtype, device=xla_runtime.device(_DEVICE_INDEX))
