"""Which launcher started this process, and where it put the process: local and global rank and size.

DeepSpeed's ``launch.py`` sets ``LOCAL_RANK``/``LOCAL_SIZE``/``CROSS_RANK``, torchrun its own names; the MPI
launchers and Slurm run the script directly and only their own variables exist. Standard library only: the
startup hook, the ``deepspeed`` runner and every worker read this before anything heavy is imported.
"""
import itertools
import os
import re
import socket
import sys
from dataclasses import dataclass
from typing import Iterator, List, Mapping, MutableMapping, Optional, Sequence, Tuple

# (local rank, local size, node rank) variables, in order of preference.
_LAYOUT_SOURCES = (
    ("LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK"),  # deepspeed.launcher.launch
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"),  # torchrun
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", None),  # OpenMPI
    ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE", None),  # MVAPICH
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),  # Intel MPI / MPICH hydra
    ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_NODEID"),  # srun
)
# (global rank, world size) variables, in order of preference: launchers, then MPI and Slurm.
_WORLD_SOURCES = (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                  ("PMI_RANK", "PMI_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))
_MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")
_DIST_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def _program() -> str:
    return sys.argv[0] if sys.argv and sys.argv[0] else ""


def is_deepspeed_runner() -> bool:
    """The ``deepspeed``/``ds`` CLI process, the one that reads ``.deepspeed_env``."""
    prog = _program()
    return os.path.basename(prog) in ("deepspeed", "ds") or prog.endswith(os.path.join("launcher", "runner.py"))


def is_launcher_process() -> bool:
    """The runner or ``deepspeed.launcher.launch``: they count devices and spawn, never train."""
    return is_deepspeed_runner() or _program().endswith(os.path.join("launcher", "launch.py"))


@dataclass(frozen=True)
class ProcessLayout:
    local_rank: int = 0
    local_size: int = 1
    node_rank: int = 0


def process_layout(env: Mapping[str, str] = os.environ) -> ProcessLayout:
    """This process's place on its host, from whichever launcher set its variables; plain python is 0 of 1."""
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


def global_rank_and_size(env: Mapping[str, str] = os.environ) -> Optional[Tuple[int, int]]:
    """This process's global rank and the world size from the launcher or MPI/Slurm, or None if none set them."""
    for rank_var, size_var in _WORLD_SOURCES:
        if rank_var in env and size_var in env:
            return int(env[rank_var]), int(env[size_var])
    return None


def launched(env: Mapping[str, str] = os.environ) -> bool:
    """Whether a launcher (DeepSpeed's, torchrun, MPI, Slurm) started this process, not plain ``python``."""
    return (any(rank in env and size in env for rank, size, _ in _LAYOUT_SOURCES)
            or any(name in env for name in _MPI_MARKERS))


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fill_single_process_env(env: MutableMapping[str, str]) -> bool:
    """Let ``python train.py`` (no launcher, no MPI) run as rank 0 of 1 instead of asking mpi4py.

    Returns whether anything was set. A partial launcher environment is left for ``check_launch_env``.
    """
    if any(name in env for name in _DIST_VARS + _MPI_MARKERS):
        return False
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return True


def fill_scheduler_env(env: MutableMapping[str, str]) -> bool:
    """Under MPI or Slurm (which start the script itself), hand DeepSpeed ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
    from the launcher's own variables once the rendezvous address is known.

    DeepSpeed would otherwise ask mpi4py, which takes rank 0's ``hostname -I`` for the address (the runner's
    ``--master_addr`` and ``--master_port`` are ignored) and, under ``srun`` without an MPI plugin, sees every
    task as rank 0 of 1. Slurm names its first node and job, which give the address and port when they are
    unset; MPI without them (``mpirun python train.py``) is left to DeepSpeed. Returns whether anything was set.
    """
    if "RANK" in env or not any(name in env for name in _MPI_MARKERS):
        return False
    position = global_rank_and_size(env)
    if position is None:
        return False
    if "SLURM_PROCID" in env:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if nodes and "MASTER_ADDR" not in env:
            env["MASTER_ADDR"] = first_slurm_host(nodes)
        if "SLURM_JOB_ID" in env and "MASTER_PORT" not in env:
            env["MASTER_PORT"] = str(slurm_master_port(env))
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return False
    env.update(RANK=str(position[0]), WORLD_SIZE=str(position[1]), LOCAL_RANK=str(process_layout(env).local_rank))
    return True


def slurm_master_port(env: Mapping[str, str]) -> int:
    """The rendezvous port of one srun step: ``15000 + (job id × 7919 + step id) mod 10000``. Every step of a job
    (``srun ... &`` twice in one allocation) gets its own port, up to 10000 steps; 7919, a prime, keeps a job's
    next steps off the ports of the jobs numbered next to it."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
    return 15000 + (int(env["SLURM_JOB_ID"]) * 7919 + int(step)) % 10000


_HOSTLIST_PART = re.compile(r"\[([^\[\]]*)\]|([^\[\],]+)")


def _bracket_items(ranges: str, nodelist: str) -> List[str]:
    """``"01-03,7"`` -> ``["01", "02", "03", "7"]``: each range keeps its first number's zero padding."""
    items = []
    for item in ranges.split(","):
        low, dash, high = item.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise ValueError(f"Slurm host list {nodelist!r} has the range {item!r}, which is not N or N-M: set "
                             "MASTER_ADDR to the first host's address.")
        width = len(low) if low.startswith("0") else 0
        items += [str(n).zfill(width) for n in range(int(low), int(high if dash else low) + 1)]
    return items


def _split_hostlist(nodelist: str) -> List[str]:
    """The top-level comma-separated entries of a host list (commas inside brackets belong to their range)."""
    entries, depth, start = [], 0, 0
    for index, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"Slurm host list {nodelist!r} has unbalanced brackets: set MASTER_ADDR to the first "
                             "host's address.")
        if char == "," and depth == 0:
            entries.append(nodelist[start:index])
            start = index + 1
    if depth:
        raise ValueError(f"Slurm host list {nodelist!r} has an unclosed '[': set MASTER_ADDR to the first host's "
                         "address.")
    return [entry for entry in entries + [nodelist[start:]] if entry]


def expand_slurm_hostlist(nodelist: str) -> Iterator[str]:
    """Every host of a Slurm host list, in Slurm's order: ``"rack[1-2]-node[01-02],gpu1"`` -> ``rack1-node01``,
    ``rack1-node02``, ``rack2-node01``, ``rack2-node02``, ``gpu1`` (several bracket groups multiply, the last
    varying fastest, as ``scontrol show hostnames`` lists them)."""
    for entry in _split_hostlist(nodelist):
        parts = [[literal] if literal else _bracket_items(ranges, nodelist)
                 for ranges, literal in _HOSTLIST_PART.findall(entry)]
        for combination in itertools.product(*parts):
            yield "".join(combination)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``"tpu-[03-05,9],gpu1"`` -> ``"tpu-03"``."""
    first = next(expand_slurm_hostlist(nodelist), None)
    if first is None:
        raise ValueError(f"Slurm host list {nodelist!r} names no host: set MASTER_ADDR to the first host's address.")
    return first


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
