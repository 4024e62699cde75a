"""The one place that imports torch_xla and calls its runtime (``xm``/``xr``/``_XLAC``).

Keeping these calls together makes the import lazy everywhere else (``import torch_xla`` takes
seconds and writes ``PJRT_DEVICE``) and leaves a single module to port to a future TPU backend.
"""
import atexit
import contextlib
import functools
from importlib import metadata
from typing import Iterator, Optional, Tuple


def base_version(version: str) -> str:
    """The release without the local build tag: ``2.9.0+cpu`` -> ``2.9.0``."""
    return version.split("+")[0]


def installed_version(name: str) -> Optional[str]:
    """The installed version of distribution ``name`` (None if absent), from metadata: imports nothing."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def pair_problem(torch_version: Optional[str], xla_version: Optional[str]) -> Optional[str]:
    """Why torch_xla cannot load with these installed versions (None when it can), naming the fix."""
    for name, version in (("torch", torch_version), ("torch_xla", xla_version)):
        if version is None:
            return (f"DS_ACCELERATOR=xla needs {name} installed: pip install torch==2.9.0 torch_xla==2.9.0 (add "
                    "torch_xla[tpu] on a TPU VM).")
    if base_version(torch_version) != base_version(xla_version):
        return (f"torch {torch_version} and torch_xla {xla_version} are not a matching pair (torch_xla is built "
                f"against one torch release): pip install torch=={base_version(xla_version)} or "
                f"torch_xla=={base_version(torch_version)}.")
    return None


def installed_pair_problem() -> Optional[str]:
    """``pair_problem`` of the installed torch and torch_xla, from metadata: imports nothing."""
    return pair_problem(installed_version("torch"), installed_version("torch_xla"))


@functools.lru_cache(maxsize=None)
def torch_xla():
    """Import torch_xla, or fail with one line that names the fix."""
    problem = installed_pair_problem()
    if problem:
        raise ImportError(problem)
    import torch_xla as module
    import torch_xla.core.xla_model  # noqa: F401
    import torch_xla.runtime  # noqa: F401
    atexit.register(_drain_before_exit)  # runs before torch_xla's own exit hook, registered at its import
    return module


def _drain_before_exit() -> None:
    """Let queued executions finish before torch_xla's exit hook, which waits for them holding the GIL.

    An execution that consumes a buffer over host memory (``device_alias``: PJRT CPU's host-staged
    collectives) frees it on an XLA thread, and that needs the GIL to release the host tensor: a script
    ending right after ``engine.step()`` deadlocked at exit. ``wait_device`` waits without the GIL.
    """
    if is_runtime_initialized():
        wait_device()


def xm():
    return torch_xla().core.xla_model


def xr():
    return torch_xla().runtime


def initialize_cache(path: str) -> None:
    """torch_xla's persistent compilation cache in ``path``; before this process's first computation."""
    xr().initialize_cache(path, readonly=False)


def is_runtime_initialized() -> bool:
    """Whether PJRT has started in this process (never starts it)."""
    import sys
    if "torch_xla" not in sys.modules:
        return False
    return bool(sys.modules["torch_xla"]._XLAC._xla_runtime_is_initialized())


def device(index: int = 0):
    import torch
    return torch.device("xla", index)


def current_device():
    """The device this thread drives (``xla:0`` in a process per device; each thread's own where one process runs
    a thread per device, as torch_xla does for PJRT CPU devices)."""
    return torch_xla().device()


def pending(tensors) -> list:
    """For each XLA tensor, whether its value is still an unexecuted graph (it has no device buffer yet)."""
    if not tensors:
        return []
    return [bool(flag) for flag in torch_xla()._XLAC._check_tensor_need_materialization(list(tensors))]


class DeviceOutOfMemory(RuntimeError):
    """An execution (or its compilation) needed more device memory than there is."""


def _names_out_of_memory(run):
    """Raise XLA's out-of-memory errors as one ``DeviceOutOfMemory`` line that names the ways out.

    XLA's text is its status (on TPU followed by pages of the program's largest allocations); a rank's uncaught
    error is what ``comm.watchdog`` prints on every other rank. The full text stays in the traceback, as the cause.
    """

    @functools.wraps(run)
    def named(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except DeviceOutOfMemory:
            raise
        except RuntimeError as error:
            text = str(error)
            if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
                raise
            status = next(line.strip() for line in text.splitlines() if line.strip())
            raise DeviceOutOfMemory(
                f"deepspeed_xla: the XLA device ({xr().device_type()}) ran out of memory ({status}): make a step need "
                "less with a smaller micro batch or sequence, activation checkpointing, ZeRO-3 (parameters "
                "partitioned) or ZeRO offload (offload_optimizer, offload_param).") from error

    return named


@_names_out_of_memory
def wait_device() -> None:
    """Block until the device finished every queued execution; unlike ``sync`` it cuts no graph."""
    xm().wait_device_ops()


@_names_out_of_memory
def sync(wait: bool = True) -> None:
    """Cut the lazy graph here and, with ``wait``, block until the device finished it."""
    torch_xla().sync()
    if wait:
        wait_device()


@_names_out_of_memory
def sync_live() -> None:
    """Execute every pending tensor of this process in one graph, without waiting for it; unlike ``sync`` it does
    not end the step (torch_xla's step marker also moves the RNG seed on)."""
    torch_xla()._XLAC._xla_sync_live_tensors("", [], wait=False)


def set_eager(enabled: bool) -> None:
    """Run every op as it is called, compiled alone and cached by shape (torch_xla's eager mode), instead of
    tracing a graph up to the next sync: a deep model's whole-step graphs are never compiled."""
    torch_xla()._XLAC._set_use_eager_mode(enabled)


@contextlib.contextmanager
def unexecuted() -> Iterator[None]:
    """Trace the block's ops, and stop it at its first execution (a sync, or a value read on the host) before that
    graph is compiled or run.

    torch_xla saves the graph first (``XLA_SAVE_TENSORS_FILE``), so its HLO can be read without the compilation.
    The rest of the block is skipped, and every tensor the graph would have computed is left without a value: drop
    them before the next sync.
    """
    runtime = torch_xla()._XLAC
    allowed = runtime._get_allow_execution()
    runtime._set_allow_execution(False)
    try:
        yield
    except RuntimeError as error:  # torch_xla's refusal, raised before it compiles
        if "Unexpected execution" not in str(error):
            raise
    finally:
        runtime._set_allow_execution(allowed)


@contextlib.contextmanager
def as_world_of(devices: int) -> Iterator[None]:
    """torch_xla's runtime counts ``devices`` in its world inside the block (its collectives check shapes by it and
    skip an all-reduce over one device): with ``unexecuted``, what one rank of that world traces, in a process whose
    XLA connects to no other device."""
    runtime = xr()
    world_size = runtime.world_size
    runtime.world_size = lambda: devices
    try:
        yield
    finally:
        runtime.world_size = world_size


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


def tpu_version() -> int:
    """The TPU generation of this host, from the TPU VM metadata (torch_xla's ``tpu.version()``)."""
    from torch_xla._internal import tpu
    return tpu.version()


def tpu_worker_ips() -> list:
    """The addresses of the slice's hosts, in worker-id order."""
    from torch_xla._internal import tpu
    return tpu.get_worker_ips()


def tpu_env() -> dict:
    """This host's TPU VM metadata (``TPU_PROCESS_BOUNDS``, ``WORKER_ID``, ...)."""
    from torch_xla._internal import tpu
    return tpu.get_tpu_env()


def register_pjrt_plugin(name: str, library: str, chips: int, client_options: dict,
                         requires_coordinator: bool) -> None:
    """Make torch_xla create the ``name`` client from PJRT plugin ``library`` with ``client_options``
    (before the runtime starts)."""
    from torch_xla.experimental import plugins

    class Plugin(plugins.DevicePlugin):

        def library_path(self) -> str:
            return library

        def physical_chip_count(self) -> int:
            return chips

        def client_create_options(self) -> dict:
            return dict(client_options)

        def requires_xla_coordinator(self) -> bool:
            return requires_coordinator

    plugins.use_dynamic_plugins()
    plugins.register_plugin(name, Plugin())


def xla_process_group_class() -> type:
    """torch_xla's ``xla`` process group class (its module may only be imported in worker processes)."""
    import torch_xla.distributed.xla_backend as xla_backend
    return xla_backend.ProcessGroupXla


@_names_out_of_memory
def to_host(tensors):
    """Materialize XLA tensors with one execution and return CPU copies."""
    tx = torch_xla()
    tx._XLAC._xla_sync_multi(tensors, devices=[], wait=True, sync_xla_data=False)
    return tx._XLAC._xla_get_cpu_tensors(tensors)


@_names_out_of_memory
def host_views(tensors):
    """Materialize XLA tensors with one execution and return host tensors sharing their buffers (DLPack).

    Only where device memory is host memory (PJRT CPU); the views are for reading: XLA buffers are
    immutable to everything else, and a scalar's may be shared through torch_xla's data cache.
    """
    tx = torch_xla()
    from torch.utils.dlpack import from_dlpack
    tx._XLAC._xla_sync_multi(tensors, devices=[], wait=True, sync_xla_data=True)
    wait_device()  # a buffer an earlier asynchronous execution is still writing has no data yet
    return [from_dlpack(tx._XLAC._to_dlpack(t)) for t in tensors]


def device_alias(host):
    """An XLA tensor over ``host``'s memory, without a copy (PJRT CPU; ``host`` must not change afterwards)."""
    return torch_xla()._XLAC._from_dlpack(host.contiguous().__dlpack__())


def graph_counters() -> dict:
    """Compilations, graph executions and device->host transfers so far in this process (torch_xla metrics).

    Waits for queued executions first: torch_xla counts an execution when it completes.
    """
    wait_device()
    return {"compilations": metric_totals("CompileTime")[0], "executions": metric_totals("ExecuteTime")[0],
            "transfers_to_host": metric_totals("TransferFromDeviceTime")[0]}


def metric_totals(name: str) -> Tuple[int, float]:
    """How many samples torch_xla's metric ``name`` took in this process, and their sum (nanoseconds for a ``*Time``
    metric, bytes for ``InboundData``); ``(0, 0.0)`` before its first. Host numbers: reading them reads no device."""
    data = torch_xla()._XLAC._xla_metric_data(name)
    return (int(data[0]), float(data[1])) if data else (0, 0.0)


def uncached_compiles() -> int:
    """Graphs this process has compiled or is compiling: torch_xla counts a graph when it misses the in-memory
    cache, before compiling it. A host counter: no wait, no device read."""
    return int(torch_xla()._XLAC._xla_counter_value("UncachedCompile") or 0)


def scalar_reads() -> int:
    """Reads of one device value on the host so far (``.item()``, ``float(t)``, ``if t:``: torch_xla's
    ``_local_scalar_dense`` counter). A host counter, cheap enough for every step; ``transfers_to_host`` counts
    every transfer but costs a read of the metric's samples (~0.3 ms)."""
    return int(torch_xla()._XLAC._xla_counter_value("aten::_local_scalar_dense") or 0)


def transfers_to_host() -> int:
    """Device->host transfers so far (torch_xla's ``TransferFromDeviceTime`` samples); a host read, no wait."""
    return metric_totals("TransferFromDeviceTime")[0]


def execution_clock() -> Tuple[float, Optional[float]]:
    """Seconds the device spent executing graphs so far in this process, and when the latest execution started
    (``time.time()``'s clock; None before the first): torch_xla's ``ExecuteTime``, whose samples are (end, duration)
    and count an execution when it completes, so wait for the device first to include the queued ones."""
    import torch_xla.debug.metrics as met
    data = met.metric_data("ExecuteTime")
    if not data:
        return 0.0, None
    end, nanoseconds = data[2][-1]
    return data[1] / 1e9, end - nanoseconds / 1e9


def _device_type(tensor) -> str:
    """The tensor's device type; the empty string for a tensor torn down under the scan ("tensor does not
    have a device": a DLPack tensor of the host staging being freed on another thread), which holds no
    buffer any more."""
    try:
        return tensor.device.type
    except RuntimeError:
        return ""


def live_device_bytes() -> int:
    """Bytes of the distinct device buffers that live XLA tensors of this process hold.

    PJRT CPU has no allocator statistics (``memory_info`` fails), so this counts what the process holds instead:
    every tensor with its own buffer, once; aliases share one and pending results have none. Call it after a sync.
    """
    import gc
    import torch
    gc.collect()  # unreachable tensors waiting for the cycle collector hold no memory anyone can use
    handles = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and _device_type(obj) == "xla":  # type(): no __class__ lookups
            try:
                handle = torch_xla()._XLAC._get_tensors_handle([obj])[0]
            except RuntimeError:  # not executed yet (or a view never materialized): no buffer of its own
                continue
            handles[handle] = obj.numel() * obj.element_size()
    return sum(handles.values())
