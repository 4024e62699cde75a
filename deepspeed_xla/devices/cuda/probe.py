"""Counting this host's NVIDIA GPUs and reading their compute capability without starting CUDA or XLA.

The ``deepspeed`` launcher asks too, so nothing here may initialize CUDA: the driver's device list
(else ``nvidia-smi -L``) narrowed by ``CUDA_VISIBLE_DEVICES``, and NVML for the capability.
"""
import ctypes
import os
import shutil
import subprocess
from functools import lru_cache
from typing import List, Optional, Tuple

#: One directory per GPU the NVIDIA kernel driver manages (a container sees its own GPUs only).
DRIVER_GPU_DIR = "/proc/driver/nvidia/gpus"
CHECK_GPUS = "`nvidia-smi -L` lists the GPUs the driver sees"


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
