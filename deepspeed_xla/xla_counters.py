"""XLA's counters as DeepSpeed monitor events: what the runtime did so far in this process, named like the engine's.

Every figure is a host number (torch_xla's metrics, the runtime's allocator statistics, the process's memory):
reading them cuts no graph and transfers nothing. The counts are totals since the process started, as torch_xla keeps
them; a count that still rises between two writes after the first steps is the thing to look at
(docs/troubleshooting.md, 'XLA's counters in the monitors').
"""
import resource
from typing import Dict, List, Tuple

from deepspeed_xla import xla_runtime

#: DeepSpeed's prefix for the engine's scalars, whose x-axis is the global sample count.
PREFIX = "Train/Samples/"


def counters() -> Dict[str, float]:
    """Compilations, their seconds, graph executions, device->host transfers and their bytes, so far in this process.

    Waits for queued executions first (no transfer, no graph cut): torch_xla counts an execution when it completes,
    and an unwaited count would race the device by one step.
    """
    xla_runtime.wait_device()
    compilations, compile_nanoseconds = xla_runtime.metric_totals("CompileTime")
    return {"xla_compilations": compilations, "xla_compile_seconds": compile_nanoseconds / 1e9,
            "xla_executions": xla_runtime.metric_totals("ExecuteTime")[0],
            "xla_transfers_to_host": xla_runtime.metric_totals("TransferFromDeviceTime")[0],
            "xla_transfer_to_host_bytes": int(xla_runtime.metric_totals("InboundData")[1])}


def memory(device_type, device) -> Dict[str, int]:
    """Device memory in use and its peak from the runtime's allocator (TPU); where it keeps none (PJRT CPU, whose
    device memory is the process's), the process's resident memory and its peak, named ``host_`` instead."""
    info = device_type.memory_info(device)
    if info is not None:
        used = info.get("bytes_used", 0)
        return {"xla_device_memory_in_use_bytes": used,
                "xla_device_memory_peak_bytes": info.get("peak_bytes_used", used)}
    import psutil
    in_use = psutil.Process().memory_info().rss
    # The kernel's high-water mark is in KiB, and its per-CPU counts can leave it some pages below the current figure.
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, in_use)
    return {"host_memory_in_use_bytes": in_use, "host_memory_peak_bytes": peak}


def monitor_events(samples: int, device_type, device) -> List[Tuple[str, float, int]]:
    """``(name, value, samples)`` of each counter and memory figure, as the engine hands events to its monitors."""
    figures = {**counters(), **memory(device_type, device)}
    return [(PREFIX + name, value, samples) for name, value in figures.items()]
