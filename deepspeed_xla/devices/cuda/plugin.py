"""The CUDA PJRT plugin: where its library is, and the client options of one GPU per process.

The options follow torch_xla 2.7's ``torch_xla_cuda_plugin`` (pytorch/xla,
``plugins/cuda/torch_xla_cuda_plugin/__init__.py``) with one deliberate difference: a single process
also gets ``visible_devices=[local_rank]``, because here a process always drives exactly one device.
Found through the ``jax-cuda12-pjrt`` wheel's metadata, without importing JAX.
"""
import os
from dataclasses import dataclass
from importlib import metadata
from typing import Dict, Mapping, Optional

from deepspeed_xla import env_vars
from deepspeed_xla.devices.cuda.wheels import PLUGIN_DISTRIBUTION, PLUGIN_VERSION, TOOLKIT_DISTRIBUTION, TOOLKIT_VERSION

PLUGIN_LIBRARY = "xla_cuda_plugin.so"
TOOLKIT_FILES = ("bin/ptxas", "nvvm/libdevice/libdevice.10.bc")
#: torch_xla's ``XlaCoordinator::kDefaultCoordinatorPort``, used when ``XLA_COORDINATOR_PORT`` is unset.
DEFAULT_COORDINATOR_PORT = "8547"


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
        "allocator": "cuda_async" if env_vars.flag(env, "PJRT_ALLOCATOR_CUDA_ASYNC") else "default",
        "memory_fraction": env_vars.number(env, "PJRT_ALLOCATOR_FRACTION"),
        "preallocate": env_vars.flag(env, "PJRT_ALLOCATOR_PREALLOCATE"),
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
