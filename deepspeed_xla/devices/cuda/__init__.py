"""NVIDIA GPUs through a CUDA PJRT plugin: one process per GPU, XLA's own collectives between them.

torch_xla 2.9 has no CUDA client of its own; it loads PJRT plugins dynamically. The plugin library
comes from JAX's ``jax-cuda12-pjrt`` wheel (``pip install 'deepspeed-xla[cuda]'``; ``plugin``). Each
worker registers it with its own client options (its GPU, node id = global rank, number of nodes =
world size) and torch_xla starts the XLA coordinator that the GPU client uses to exchange topology
across processes. Nothing here starts the runtime before ``prepare_runtime``: ``local_device_count``
runs in the ``deepspeed`` launcher (``probe``).
"""
import os
from importlib import metadata
from typing import List, Mapping, MutableMapping, Optional, Tuple

from deepspeed_xla import launch_env, xla_runtime
from deepspeed_xla.devices.base import DeviceType
from deepspeed_xla.devices.cuda.plugin import (PLUGIN_DISTRIBUTION, CudaProcessSettings, cuda_process_settings,
                                               plugin_library, toolkit_problem)
from deepspeed_xla.devices.cuda.probe import CHECK_GPUS, compute_capability, host_gpu_count, visible_gpu_count

#: What XLA's GPU client raises when CUDA shows it no device (driver missing, or no usable GPU).
NO_GPU_ERROR = "No visible GPU devices"


def global_rank_and_size(env, local_size: int) -> Tuple[int, int]:
    """This process's global rank and the world size, which the GPU client and its coordinator need."""
    position = launch_env.global_rank_and_size(env)
    if position is not None:
        return position
    if local_size == 1:
        return 0, 1
    raise RuntimeError("PJRT_DEVICE=CUDA with several processes needs each process's RANK and WORLD_SIZE (or the "
                       "MPI/Slurm equivalents) before its first device use: start it with the deepspeed launcher, "
                       "torchrun, mpirun or srun.")


class CudaDevice(DeviceType):
    pjrt_name = "CUDA"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    has_xla_collectives = True
    comm_backend = "xla_ds"
    unverified = ("not yet run on a GPU: plugin loading, the coordinator start and the no-GPU error are tested "
                  "on CPU-only CI; training on GPUs is unverified (run scripts/gpu_smoke.sh; see docs/gpu.md)")

    def __init__(self):
        self._library: Optional[str] = None
        self.settings: Optional[CudaProcessSettings] = None  # this process's, from configure_process

    def is_present(self) -> bool:
        return self.local_device_count() > 0

    def local_device_count(self, env: Mapping[str, str] = os.environ) -> int:
        """GPUs this process may use: the driver's list (else ``nvidia-smi -L``) narrowed by
        ``CUDA_VISIBLE_DEVICES``; neither CUDA nor XLA is initialized."""
        return visible_gpu_count(host_gpu_count()[0], env.get(self.visible_devices_env))

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
        xla_runtime.register_pjrt_plugin(self.pjrt_name, self._library, self.local_device_count(),
                                         self.settings.client_options, self.settings.requires_coordinator)
        try:
            xla_runtime.xr().addressable_device_count()
        except RuntimeError as exc:
            if NO_GPU_ERROR not in str(exc):
                raise
            gpu = self.settings.client_options["visible_devices"][0]
            raise RuntimeError(f"The CUDA PJRT plugin ({self._library}) could not start on visible GPU {gpu}: {exc} "
                               f"To fix: {self._no_gpu_fix()}.") from exc

    def is_bf16_supported(self) -> bool:
        """Native bf16 (compute capability 8.0, Ampere, and newer); XLA would only emulate it below."""
        return compute_capability() >= (8, 0)

    def is_fp16_supported(self) -> bool:
        """DeepSpeed's CUDA rule: Volta (7.x) and newer; 6.x only with ``DS_ALLOW_DEPRECATED_FP16=1``."""
        major = compute_capability()[0]
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")

    def export_env_prefixes(self):
        return super().export_env_prefixes() + ["CUDA_", "NCCL_"]
