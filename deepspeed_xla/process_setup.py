"""Each worker's one-time device setup, before its first XLA use: this replaces ``xmp.spawn``.

``setup_process()`` writes this process's PJRT topology (from ``launch_env.process_layout``) before the
runtime starts (in a launched worker as soon as torch_xla is imported: ``on_torch_xla_loaded``), so that
plain subprocess launching (DeepSpeed's launchers, torchrun, MPI, Slurm) gives one process per device. The
launcher's own check of its host (``check_host_launch``) lives here too: it asks the same question without
starting anything. ``DS_XLA_COMPILATION_CACHE`` gives each worker torch_xla's persistent compilation cache
(``compilation_cache_dir``). What the setup writes into the environment is this process's alone
(``process_env``): the processes it starts set up their own devices.
"""
import os
from typing import Mapping, Optional, Sequence

from deepspeed_xla import compile_watch, xla_runtime
from deepspeed_xla.devices import DeviceType, current_device_type, wants_xla
from deepspeed_xla.launch_env import ProcessLayout, is_launcher_process, launched, process_layout
from deepspeed_xla.process_env import for_this_process


COMPILATION_CACHE_ENV = "DS_XLA_COMPILATION_CACHE"


def compilation_cache_dir(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """This process's folder of torch_xla's persistent compilation cache, when ``DS_XLA_COMPILATION_CACHE`` names
    a root: ``<root>/rank<RANK>``. One folder per rank: the processes of a host never write one entry at once, and
    a relaunch of the same job (after a preemption) finds what each of its ranks compiled."""
    root = env.get(COMPILATION_CACHE_ENV)
    return os.path.join(root, f"rank{env.get('RANK', '0')}") if root else None


def process_count_problem(device_type: DeviceType, processes: int) -> Optional[str]:
    """Why this host cannot run ``processes`` workers of ``device_type``, naming the fix (None if it can).
    Never starts the runtime: each host's launcher asks before starting workers, each worker at setup."""
    available = device_type.local_device_count()
    if available == 0:
        return (" ".join(device_type.setup_problems()) or
                f"PJRT_DEVICE={device_type.pjrt_name} but this host has no {device_type.pjrt_name} device: "
                "run on a host that has one, or set PJRT_DEVICE=CPU.")
    return device_type.process_count_problem(processes, available)


def check_host_launch(device_type: DeviceType, device_ids: Sequence[int]) -> None:
    """``deepspeed.launcher.launch``'s check of its host before it starts one worker per id (``--num_gpus`` or
    the hostfile's ``slots=``): one error from the launcher instead of the same error from every worker.
    Reads package metadata only: a launcher must not import torch_xla (that could lock the TPU chips)."""
    problem = xla_runtime.installed_pair_problem() or process_count_problem(device_type, len(device_ids))
    if problem:
        raise RuntimeError(problem)


_prepared: Optional[ProcessLayout] = None
_layout: Optional[ProcessLayout] = None


def prepare_process(device_type: Optional[DeviceType] = None) -> ProcessLayout:
    """The half of the set-up that must come before the XLA runtime starts: this process's PJRT topology, the
    compilation cache, the device type's runtime preparation (e.g. its PJRT plugin). Once per process.

    A launched worker runs it when torch_xla is imported (``on_torch_xla_loaded``), so that a library which touches
    the device before DeepSpeed does (accelerate's ``PartialState``, built with the Trainer) starts the runtime with
    this process's topology; other processes at their first device use."""
    global _prepared
    if _prepared is None:
        xla_runtime.torch_xla()  # in a launched worker, the import prepares the process (on_torch_xla_loaded)
    if _prepared is not None:
        return _prepared
    layout = process_layout()
    if layout.local_size > 1 and xla_runtime.is_runtime_initialized():
        raise RuntimeError(
            f"The XLA runtime was started in this process (local rank {layout.local_rank} of "
            f"{layout.local_size}) before deepspeed_xla set up its per-process device topology. Do not touch "
            "the XLA device (torch_xla.device(), .to('xla'), torch_xla.runtime.world_size(), ...) before "
            "deepspeed.init_distributed()/deepspeed.initialize(), or call deepspeed_xla.setup_process() first.")
    device_type = device_type or current_device_type()
    problem = process_count_problem(device_type, layout.local_size)
    if problem:
        raise RuntimeError(problem)
    with for_this_process():
        device_type.configure_process(layout.local_rank, layout.local_size, layout.node_rank, os.environ)
        compile_watch.enable_analysis(os.environ)
        cache = compilation_cache_dir()
        if cache:
            xla_runtime.initialize_cache(cache)
        device_type.prepare_runtime()
    _prepared = layout
    return layout


def setup_process(device_type: Optional[DeviceType] = None) -> ProcessLayout:
    """Configure this process's device once, before its first XLA use by DeepSpeed; safe to call again:
    ``prepare_process``, then the XLA collectives' replication across the world (device types that have them).

    ``device_type``: the accelerator's; this process's ``current_device_type()`` when called directly."""
    global _layout
    if _layout is not None:
        return _layout
    device_type = device_type or current_device_type()
    layout = prepare_process(device_type)
    if layout.local_size > 1 and device_type.has_xla_collectives:
        with for_this_process():
            xla_runtime.initialize_multiprocess(layout.local_rank, layout.local_size)
        _check_ordinal()
    _layout = layout
    return layout


def is_prepared() -> bool:
    """Whether ``prepare_process`` ran in this process (a fork child of a process whose runtime had not started
    prepares its own)."""
    return _prepared is not None


def _forget_in_child() -> None:
    """A fork child whose parent was prepared but had not started its runtime yet (a pool of ranks started by a
    process that asked for its device) sets up its own device: its environment is its parent's launch environment
    again (``process_env``). A child of a running runtime (a DataLoader worker) keeps the parent's answers."""
    global _prepared, _layout
    if not xla_runtime.is_runtime_initialized():
        _prepared = _layout = None


os.register_at_fork(after_in_child=_forget_in_child)


def on_torch_xla_loaded(module) -> None:
    """Startup-hook entry, right after torch_xla's import: a launched worker of an XLA run prepares its device now,
    before any library can start the runtime. The launchers themselves import nothing that needs a device."""
    if wants_xla() and launched() and not is_launcher_process():
        prepare_process()


def _check_ordinal() -> None:
    rank = os.environ.get("RANK")
    if rank is None:
        return
    ordinal = xla_runtime.global_ordinal()
    if ordinal != int(rank):
        raise RuntimeError(
            f"This process has DeepSpeed RANK={rank} but XLA global ordinal {ordinal}: the XLA collectives would "
            "mix up ranks. List hosts in the hostfile in TPU worker-id order (TPU_WORKER_ID 0, 1, ...) and "
            "start the same number of processes on every host.")
