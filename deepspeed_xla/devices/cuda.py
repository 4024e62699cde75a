"""NVIDIA GPUs through a CUDA PJRT plugin: one process per GPU, XLA's own collectives between them.

torch_xla 2.9 has no CUDA client of its own; it loads PJRT plugins dynamically. The plugin library
comes from JAX's ``jax-cuda12-pjrt`` wheel (``pip install 'deepspeed-xla[cuda]'``), found through the
wheel's metadata without importing JAX. Each worker registers it with its own client options (its
GPU, node id = global rank, number of nodes = world size) and torch_xla starts the XLA coordinator
that the GPU client uses to exchange topology across processes.

The options follow torch_xla 2.7's ``torch_xla_cuda_plugin`` (pytorch/xla,
``plugins/cuda/torch_xla_cuda_plugin/__init__.py``) with one deliberate difference: a single process
also gets ``visible_devices=[local_rank]``, because here a process always drives exactly one device.

Nothing here starts the runtime before ``prepare_runtime``: ``local_device_count`` runs in the
``deepspeed`` launcher, from the driver's device list and ``CUDA_VISIBLE_DEVICES``.
"""
import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from typing import Dict, List, Mapping, MutableMapping, Optional, Tuple

from deepspeed_xla import xla_runtime
from deepspeed_xla.devices.base import DeviceType

PLUGIN_DISTRIBUTION = "jax-cuda12-pjrt"
PLUGIN_VERSION = "0.7.1"  # the JAX release torch_xla 2.9 pins for Pallas: the same XLA era
PLUGIN_LIBRARY = "xla_cuda_plugin.so"
#: CUDA's ptxas and libdevice, which XLA needs to compile kernels; torch's CUDA wheels do not bring them.
TOOLKIT_DISTRIBUTION = "nvidia-cuda-nvcc-cu12"
TOOLKIT_VERSION = "12.8.93"  # the CUDA 12.8 of torch 2.9.0's CUDA libraries
TOOLKIT_FILES = ("bin/ptxas", "nvvm/libdevice/libdevice.10.bc")
#: One directory per GPU the NVIDIA kernel driver manages (a container sees its own GPUs only).
DRIVER_GPU_DIR = "/proc/driver/nvidia/gpus"
#: torch_xla's ``XlaCoordinator::kDefaultCoordinatorPort``, used when ``XLA_COORDINATOR_PORT`` is unset.
DEFAULT_COORDINATOR_PORT = "8547"
#: What XLA's GPU client raises when CUDA shows it no device (driver missing, or no usable GPU).
NO_GPU_ERROR = "No visible GPU devices"
CHECK_GPUS = "`nvidia-smi -L` lists the GPUs the driver sees"

# (global rank, world size) variables, in order of preference: launchers, then MPI and Slurm.
_WORLD_SOURCES = (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                  ("PMI_RANK", "PMI_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))


def driver_gpu_count() -> Optional[int]:
    """GPUs in the kernel driver's list, or None where the driver exposes none (not loaded, or WSL)."""
    try:
        return len(os.listdir(DRIVER_GPU_DIR))
    except OSError:
        return None


def nvidia_smi_gpu_count(exe: str) -> int:
    """GPUs ``nvidia-smi -L`` lists; 0 when it cannot reach the driver."""
    try:
        proc = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if proc.returncode != 0:
        return 0
    return sum(1 for line in proc.stdout.splitlines() if line.startswith("GPU "))


def host_gpu_count() -> Tuple[int, str]:
    """GPUs on this host, and where the number comes from: the driver's list, else ``nvidia-smi -L``."""
    count = driver_gpu_count()
    if count is not None:
        return count, DRIVER_GPU_DIR
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0, f"no {DRIVER_GPU_DIR} and no nvidia-smi"
    return nvidia_smi_gpu_count(exe), "nvidia-smi -L"


def visible_gpu_count(host_gpus: int, cuda_visible: Optional[str]) -> int:
    """How many of ``host_gpus`` CUDA would show a process with this ``CUDA_VISIBLE_DEVICES``.

    CUDA's rules: unset shows all; otherwise the listed indices (or ``GPU-``/``MIG-`` UUIDs) up to the
    first entry that is invalid, out of range or repeated.
    """
    if cuda_visible is None:
        return host_gpus
    seen = set()
    for entry in (e.strip() for e in cuda_visible.split(",")):
        valid = entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < host_gpus)
        if not valid or entry in seen:
            break
        seen.add(entry)
    return min(len(seen), host_gpus)


def _env_flag(env: Mapping[str, str], name: str) -> Optional[bool]:
    """torch_xla's boolean variables are integers (``xu.getenv_as(name, bool)``: ``bool(int(value))``)."""
    value = env.get(name)
    if value is None:
        return None
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer: set it to 1 (on) or 0 (off).") from None


def _env_float(env: Mapping[str, str], name: str) -> Optional[float]:
    value = env.get(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number: set it to a fraction such as 0.75.") from None


@dataclass(frozen=True)
class CudaProcessSettings:
    """What one process hands torch_xla: the PJRT client options, and the variables from which torch_xla's
    runtime starts the XLA coordinator (when one is required)."""
    client_options: Dict[str, object]
    requires_coordinator: bool
    env: Dict[str, str]


def cuda_process_settings(local_rank: int, local_size: int, global_rank: int, world_size: int,
                          env: Mapping[str, str]) -> CudaProcessSettings:
    """Client options of the GPU PJRT plugin for one GPU per process, and the coordinator setup.

    ``env`` supplies the allocator knobs (``PJRT_ALLOCATOR_CUDA_ASYNC``, ``PJRT_ALLOCATOR_FRACTION``,
    ``PJRT_ALLOCATOR_PREALLOCATE``) and the coordinator address (``MASTER_ADDR``,
    ``XLA_COORDINATOR_PORT``), which torch_xla's runtime reads when it creates the client.
    """
    options = {
        "platform_name": "gpu",
        "allocator": "cuda_async" if _env_flag(env, "PJRT_ALLOCATOR_CUDA_ASYNC") else "default",
        "memory_fraction": _env_float(env, "PJRT_ALLOCATOR_FRACTION"),
        "preallocate": _env_flag(env, "PJRT_ALLOCATOR_PREALLOCATE"),
        "visible_devices": [local_rank],
        "node_id": global_rank,
        "num_nodes": world_size,
    }
    if world_size > local_size and "MASTER_ADDR" not in env:
        raise RuntimeError("PJRT_DEVICE=CUDA on several hosts needs MASTER_ADDR (the first host's address) in every "
                           "process: the XLA coordinator runs there. The deepspeed launcher and torchrun set it.")
    coordinator_env = {
        "PJRT_LOCAL_PROCESS_RANK": str(local_rank),
        "PJRT_LOCAL_PROCESS_COUNT": str(local_size),
        "RANK": str(global_rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": env.get("MASTER_ADDR", "localhost"),
        "XLA_COORDINATOR_PORT": env.get("XLA_COORDINATOR_PORT", DEFAULT_COORDINATOR_PORT),
    }
    return CudaProcessSettings({k: v for k, v in options.items() if v is not None}, world_size > 1, coordinator_env)


def global_rank_and_size(env: Mapping[str, str], local_size: int) -> Tuple[int, int]:
    """This process's global rank and the world size, which the GPU client and its coordinator need."""
    for rank_var, size_var in _WORLD_SOURCES:
        if rank_var in env and size_var in env:
            return int(env[rank_var]), int(env[size_var])
    if local_size == 1:
        return 0, 1
    raise RuntimeError("PJRT_DEVICE=CUDA with several processes needs each process's RANK and WORLD_SIZE (or the "
                       "MPI/Slurm equivalents) before its first device use: start it with the deepspeed launcher, "
                       "torchrun, mpirun or srun.")


def plugin_library() -> str:
    """Path of the CUDA PJRT plugin inside the installed ``jax-cuda12-pjrt`` wheel (JAX is not imported)."""
    try:
        dist = metadata.distribution(PLUGIN_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise ImportError(f"PJRT_DEVICE=CUDA needs the CUDA PJRT plugin: pip install 'deepspeed-xla[cuda]' (or "
                          f"pip install {PLUGIN_DISTRIBUTION}=={PLUGIN_VERSION} --no-deps).") from None
    for entry in dist.files or ():
        if entry.name == PLUGIN_LIBRARY and os.path.isfile(dist.locate_file(entry)):
            return str(dist.locate_file(entry))
    raise ImportError(f"{PLUGIN_DISTRIBUTION} {dist.version} is installed without {PLUGIN_LIBRARY}: reinstall it "
                      f"(pip install --force-reinstall --no-deps {PLUGIN_DISTRIBUTION}=={PLUGIN_VERSION}).")


def toolkit_problem(library: str) -> Optional[str]:
    """Why XLA could not compile for the GPU (None when it can): it looks for ptxas and libdevice in
    ``../../nvidia/cuda_nvcc`` from the plugin library's folder, i.e. the nvcc wheel in the same site-packages."""
    nvcc = os.path.join(os.path.dirname(library), "..", "..", "nvidia", "cuda_nvcc")
    missing = [name for name in TOOLKIT_FILES if not os.path.isfile(os.path.join(nvcc, name))]
    if not missing:
        return None
    return (f"XLA needs CUDA's {' and '.join(missing)} in {os.path.normpath(nvcc)} to compile for the GPU: pip install "
            f"'deepspeed-xla[cuda]' (or pip install {TOOLKIT_DISTRIBUTION}=={TOOLKIT_VERSION} --no-deps) into the "
            f"environment that has {PLUGIN_DISTRIBUTION}.")


def register_plugin(library: str, settings: CudaProcessSettings, local_gpus: int) -> None:
    """Make torch_xla create its CUDA client from ``library`` with ``settings`` (before the runtime starts)."""
    from torch_xla.experimental import plugins

    class CudaPlugin(plugins.DevicePlugin):

        def library_path(self) -> str:
            return library

        def physical_chip_count(self) -> int:
            return local_gpus

        def client_create_options(self) -> dict:
            return dict(settings.client_options)

        def requires_xla_coordinator(self) -> bool:
            return settings.requires_coordinator

    plugins.use_dynamic_plugins()
    plugins.register_plugin(CudaDevice.pjrt_name, CudaPlugin())


@lru_cache(maxsize=None)
def compute_capability() -> Tuple[int, int]:
    """The lowest CUDA compute capability among this host's GPUs, from NVML (the driver's library).

    NVML needs no CUDA context and no XLA runtime, so the launcher may ask too. NVML's order is not
    CUDA's, hence the lowest: exact on the usual host with one GPU model.
    """
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        raise RuntimeError("Cannot read the GPUs' compute capability: libnvidia-ml.so.1 (installed with the NVIDIA "
                           f"driver) is not loadable. Check that {CHECK_GPUS}; in a container, run it with "
                           "NVIDIA_DRIVER_CAPABILITIES=compute,utility.") from None
    return min(_nvml_capabilities(nvml))


def _nvml_capabilities(nvml) -> List[Tuple[int, int]]:

    def check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"NVML {call} failed with status {status}: check that {CHECK_GPUS}.")

    check(nvml.nvmlInit_v2(), "nvmlInit")
    try:
        count = ctypes.c_uint()
        check(nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)), "nvmlDeviceGetCount")
        if count.value == 0:
            raise RuntimeError(f"NVML lists no GPU: check that {CHECK_GPUS}.")
        capabilities = []
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            check(nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)), "nvmlDeviceGetHandleByIndex")
            check(nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)),
                  "nvmlDeviceGetCudaComputeCapability")
            capabilities.append((major.value, minor.value))
        return capabilities
    finally:
        nvml.nvmlShutdown()


class CudaDevice(DeviceType):
    pjrt_name = "CUDA"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    has_xla_collectives = True
    unverified = ("not yet run on a GPU: plugin loading, the coordinator start and the no-GPU error are tested "
                  "on CPU-only CI; training on GPUs is unverified (run scripts/gpu_smoke.sh; see docs/gpu.md)")

    def __init__(self):
        self._library: Optional[str] = None
        self.settings: Optional[CudaProcessSettings] = None  # this process's, from configure_process

    def is_present(self) -> bool:
        return self.local_device_count() > 0

    def local_device_count(self) -> int:
        """GPUs this process may use: the driver's list (else ``nvidia-smi -L``) narrowed by
        ``CUDA_VISIBLE_DEVICES``; neither CUDA nor XLA is initialized."""
        return visible_gpu_count(host_gpu_count()[0], os.environ.get(self.visible_devices_env))

    def too_few_devices_hint(self) -> str:
        return f"or make more GPUs visible ({CHECK_GPUS}; CUDA_VISIBLE_DEVICES, if set, must name them)"

    def describe(self) -> str:
        visible = os.environ.get(self.visible_devices_env)
        host_gpus, source = host_gpu_count()
        narrowed = f", narrowed by CUDA_VISIBLE_DEVICES={visible}" if visible is not None else ""
        try:
            plugin = f"{PLUGIN_DISTRIBUTION} {metadata.version(PLUGIN_DISTRIBUTION)} ({plugin_library()})"
        except ImportError:
            plugin = "not installed"
        return (f"{visible_gpu_count(host_gpus, visible)} GPU(s) visible (host: {host_gpus}, from {source}{narrowed}); "
                f"CUDA PJRT plugin: {plugin}")

    def setup_problems(self) -> List[str]:
        problems = []
        if self.local_device_count() == 0:
            problems.append(f"PJRT_DEVICE=CUDA but no GPU is visible to this process: {self._no_gpu_fix()}.")
        try:
            problems.append(toolkit_problem(plugin_library()))
        except ImportError as exc:
            problems.append(str(exc))
        return [problem for problem in problems if problem]

    def _no_gpu_fix(self) -> str:
        visible = os.environ.get(self.visible_devices_env)
        narrowed = f" and that CUDA_VISIBLE_DEVICES={visible!r} names them" if visible is not None else ""
        return f"check that {CHECK_GPUS}{narrowed}, or set PJRT_DEVICE=CPU to run XLA on the host CPU"

    def configure_process(self, local_rank, local_size, node_rank, env: MutableMapping[str, str]) -> None:
        self._library = plugin_library()
        problem = toolkit_problem(self._library)
        if problem:
            raise ImportError(problem)
        global_rank, world_size = global_rank_and_size(env, local_size)
        self.settings = cuda_process_settings(local_rank, local_size, global_rank, world_size, env)
        for key, value in self.settings.env.items():
            env.setdefault(key, value)

    def prepare_runtime(self) -> None:
        """Register the plugin and start the client now, so that a GPU the plugin cannot use fails here, with the
        fix, rather than at the first tensor. Other start-up errors (coordinator, driver) keep XLA's message."""
        register_plugin(self._library, self.settings, self.local_device_count())
        try:
            xla_runtime.xr().addressable_device_count()
        except RuntimeError as exc:
            if NO_GPU_ERROR not in str(exc):
                raise
            gpu = self.settings.client_options["visible_devices"][0]
            raise RuntimeError(f"The CUDA PJRT plugin ({self._library}) could not start on visible GPU {gpu}: {exc} "
                               f"To fix: {self._no_gpu_fix()}.") from exc

    def communication_backend(self) -> str:
        from deepspeed_xla.comm import xla_collectives
        xla_collectives.register()
        return xla_collectives.BACKEND_NAME

    def is_bf16_supported(self) -> bool:
        """Native bf16 (compute capability 8.0, Ampere, and newer); XLA would only emulate it below."""
        return compute_capability() >= (8, 0)

    def is_fp16_supported(self) -> bool:
        """DeepSpeed's CUDA rule: Volta (7.x) and newer; 6.x only with ``DS_ALLOW_DEPRECATED_FP16=1``."""
        major = compute_capability()[0]
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")

    def export_env_prefixes(self):
        return super().export_env_prefixes() + ["CUDA_", "NCCL_"]
