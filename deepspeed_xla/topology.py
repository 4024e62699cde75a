"""Where this process sits (local rank, local size, node) and its one-time device setup.

DeepSpeed's ``launch.py`` sets ``LOCAL_RANK``/``LOCAL_SIZE``/``CROSS_RANK``; the MPI and Slurm
launchers run the script directly and only their own variables exist. ``setup_process()`` writes the
per-process PJRT topology before the runtime starts: that is what lets plain ``subprocess`` launching
(DeepSpeed's launchers) replace ``xmp.spawn``.
"""
import os
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Optional, Sequence

from deepspeed_xla import xla_runtime
from deepspeed_xla.devices import current_device_type

# (local rank, local size, node rank) variables, in order of preference.
_LAYOUT_SOURCES = (
    ("LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK"),  # deepspeed.launcher.launch
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"),  # torchrun
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", None),  # OpenMPI
    ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE", None),  # MVAPICH
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),  # Intel MPI / MPICH hydra
    ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_NODEID"),  # srun
)


@dataclass(frozen=True)
class ProcessLayout:
    local_rank: int = 0
    local_size: int = 1
    node_rank: int = 0


def process_layout(env: Mapping[str, str] = os.environ) -> ProcessLayout:
    for rank_var, size_var, node_var in _LAYOUT_SOURCES:
        if rank_var in env and size_var in env:
            node = int(env.get(node_var, 0)) if node_var else 0
            return ProcessLayout(int(env[rank_var]), int(env[size_var]), node)
    if "SLURM_LOCALID" in env and "SLURM_STEP_TASKS_PER_NODE" in env:
        node = int(env.get("SLURM_STEP_NODEID", env.get("SLURM_NODEID", 0)))
        tasks = slurm_tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
        return ProcessLayout(int(env["SLURM_LOCALID"]), tasks[node], node)
    return ProcessLayout(int(env.get("LOCAL_RANK", 0)), 1, 0)


def slurm_tasks_per_node(value: str) -> Sequence[int]:
    """Slurm's compressed per-node task counts, e.g. ``"4(x2),3"`` -> ``[4, 4, 3]``.

    srun sets ``SLURM_NTASKS_PER_NODE`` only with ``--ntasks-per-node``; this form is always there.
    """
    counts = []
    for item in value.split(","):
        count, _, repeat = item.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts


_MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")
_DIST_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def fill_single_process_env(env: MutableMapping[str, str]) -> bool:
    """Let ``python train.py`` (no launcher, no MPI) run as rank 0 of 1 instead of asking mpi4py.

    Returns whether anything was set. A partial launcher environment is left for ``check_launch_env``.
    """
    if any(name in env for name in _DIST_VARS + _MPI_MARKERS):
        return False
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    return True


def launched(env: Mapping[str, str] = os.environ) -> bool:
    """Whether a launcher (DeepSpeed's, torchrun, MPI, Slurm) started this process, not plain ``python``."""
    return (any(rank in env and size in env for rank, size, _ in _LAYOUT_SOURCES)
            or any(name in env for name in _MPI_MARKERS))


def check_launch_env(env: Mapping[str, str] = os.environ) -> None:
    """Refuse part of the torch.distributed environment outside MPI, before DeepSpeed's ``init_distributed``.

    DeepSpeed would take it for an MPI launch and fail on ``import mpi4py`` (or, with mpi4py installed,
    run as rank 0 of 1), which names neither the cause nor the fix.
    """
    present = [name for name in _DIST_VARS if name in env]
    if not present or len(present) == len(_DIST_VARS) or any(name in env for name in _MPI_MARKERS):
        return
    missing = [name for name in _DIST_VARS if name not in env]
    raise RuntimeError(
        f"This process has {', '.join(f'{name}={env[name]}' for name in present)} but no {', '.join(missing)}: "
        "it was started without a launcher. Start the script with the deepspeed launcher (deepspeed --num_gpus N "
        f"script.py) or torchrun, or unset {' '.join(present)} to run it as one process with plain python.")


def process_count_problem(processes: int) -> Optional[str]:
    """Why this host cannot run ``processes`` workers of the current device type, naming the fix (None if it
    can). Never starts the runtime: each host's launcher asks before starting workers, each worker at setup."""
    device_type = current_device_type()
    available = device_type.local_device_count()
    if available == 0:
        return (" ".join(device_type.setup_problems()) or
                f"PJRT_DEVICE={device_type.pjrt_name} but this host has no {device_type.pjrt_name} device: "
                "run on a host that has one, or set PJRT_DEVICE=CPU.")
    return device_type.process_count_problem(processes, available)


def check_host_launch(device_ids: Sequence[int]) -> None:
    """``deepspeed.launcher.launch``'s check of its host before it starts one worker per id (``--num_gpus`` or
    the hostfile's ``slots=``): one error from the launcher instead of the same error from every worker.
    Reads package metadata only: a launcher must not import torch_xla (that could lock the TPU chips)."""
    problem = xla_runtime.installed_pair_problem() or process_count_problem(len(device_ids))
    if problem:
        raise RuntimeError(problem)


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_layout: Optional[ProcessLayout] = None


def setup_process() -> ProcessLayout:
    """Configure this process's device once, before its first XLA use; safe to call again."""
    global _layout
    if _layout is not None:
        return _layout
    layout = process_layout()
    if layout.local_size > 1 and xla_runtime.is_runtime_initialized():
        raise RuntimeError(
            f"The XLA runtime was started in this process (local rank {layout.local_rank} of "
            f"{layout.local_size}) before deepspeed_xla set up its per-process device topology. Do not touch "
            "the XLA device (torch_xla.device(), .to('xla'), torch_xla.runtime.world_size(), ...) before "
            "deepspeed.init_distributed()/deepspeed.initialize(), or call deepspeed_xla.setup_process() first.")
    problem = process_count_problem(layout.local_size)
    if problem:
        raise RuntimeError(problem)
    device_type = current_device_type()
    device_type.configure_process(layout.local_rank, layout.local_size, layout.node_rank, os.environ)
    xla_runtime.torch_xla()
    device_type.prepare_runtime()
    if layout.local_size > 1 and device_type.has_xla_collectives:
        xla_runtime.initialize_multiprocess(layout.local_rank, layout.local_size)
        _check_ordinal()
    _layout = layout
    return layout


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
