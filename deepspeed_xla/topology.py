"""Where this process sits (local rank, local size, node) and its one-time device setup.

DeepSpeed's ``launch.py`` sets ``LOCAL_RANK``/``LOCAL_SIZE``/``CROSS_RANK``; the MPI and Slurm
launchers run the script directly and only their own variables exist. ``setup_process()`` writes the
per-process PJRT topology before the runtime starts: that is what lets plain ``subprocess`` launching
(DeepSpeed's launchers) replace ``xmp.spawn``.
"""
import os
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Optional

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
    return ProcessLayout(int(env.get("LOCAL_RANK", 0)), 1, 0)


_MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")
_DIST_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def fill_single_process_env(env: MutableMapping[str, str]) -> bool:
    """Let ``python train.py`` (no launcher, no MPI) run as rank 0 of 1 instead of asking mpi4py.

    Returns whether anything was set. A partial launcher environment is left for DeepSpeed to reject.
    """
    if any(name in env for name in _DIST_VARS + _MPI_MARKERS):
        return False
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    return True


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
    device_type = current_device_type()
    available = device_type.local_device_count()
    if layout.local_size > available:
        raise RuntimeError(
            f"{layout.local_size} processes were started on this host but it has {available} "
            f"{device_type.pjrt_name} device(s): launch with deepspeed --num_gpus {available} (or fewer), "
            f"{device_type.too_few_devices_hint()}.")
    device_type.configure_process(layout.local_rank, layout.local_size, layout.node_rank, os.environ)
    xla_runtime.torch_xla()
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
