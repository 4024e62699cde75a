"""The one place that imports torch_xla and calls its runtime (``xm``/``xr``/``_XLAC``).

Keeping these calls together makes the import lazy everywhere else (``import torch_xla`` takes
seconds and writes ``PJRT_DEVICE``) and leaves a single module to port to a future TPU backend.
"""
import functools
from importlib import metadata


def _base_version(version: str) -> str:
    return version.split("+")[0]


@functools.lru_cache(maxsize=None)
def torch_xla():
    """Import torch_xla, or fail with one line that names the fix."""
    try:
        torch_version = metadata.version("torch")
        xla_version = metadata.version("torch_xla")
    except metadata.PackageNotFoundError as exc:
        raise ImportError(f"DS_ACCELERATOR=xla needs {exc.name} installed: pip install torch==2.9.0 "
                          "torch_xla==2.9.0 (add torch_xla[tpu] on a TPU VM).") from None
    if _base_version(torch_version) != _base_version(xla_version):
        raise ImportError(f"torch {torch_version} and torch_xla {xla_version} are not a matching pair (torch_xla is "
                          f"built against one torch release): pip install torch=={_base_version(xla_version)} "
                          f"or torch_xla=={_base_version(torch_version)}.")
    import torch_xla as module
    import torch_xla.core.xla_model  # noqa: F401
    import torch_xla.runtime  # noqa: F401
    return module


def xm():
    return torch_xla().core.xla_model


def xr():
    return torch_xla().runtime


def is_runtime_initialized() -> bool:
    """Whether PJRT has started in this process (never starts it)."""
    import sys
    if "torch_xla" not in sys.modules:
        return False
    return bool(sys.modules["torch_xla"]._XLAC._xla_runtime_is_initialized())


def device(index: int = 0):
    import torch
    return torch.device("xla", index)


def sync(wait: bool = True) -> None:
    """Cut the lazy graph here and, with ``wait``, block until the device finished it."""
    torch_xla().sync()
    if wait:
        xm().wait_device_ops()


def set_seed(seed: int) -> None:
    xm().set_rng_state(int(seed))


def get_seed() -> int:
    return int(xm().get_rng_state())


def memory_info(dev):
    return xm().get_memory_info(dev)


def global_ordinal() -> int:
    return xr().global_ordinal()


def initialize_multiprocess(local_rank: int, local_size: int) -> None:
    """Start PJRT with this process's topology and set XLA replication across the world."""
    from torch_xla._internal import pjrt
    pjrt.initialize_multiprocess(local_rank, local_size)


def to_host(tensors):
    """Materialize XLA tensors with one execution and return CPU copies."""
    tx = torch_xla()
    tx._XLAC._xla_sync_multi(tensors, devices=[], wait=True, sync_xla_data=False)
    return tx._XLAC._xla_get_cpu_tensors(tensors)


def graph_counters() -> dict:
    """Compilations, graph executions and device->host transfers so far in this process (torch_xla metrics)."""
    import torch_xla.debug.metrics as met

    def count(name):
        data = met.metric_data(name)
        return int(data[0]) if data else 0

    return {"compilations": count("CompileTime"), "executions": count("ExecuteTime"),
            "transfers_to_host": count("TransferFromDeviceTime")}
