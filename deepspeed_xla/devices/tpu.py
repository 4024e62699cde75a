"""Cloud TPU: chips found on PCI, one process per chip, torch_xla's ``xla`` process group.

Nothing here may start the PJRT runtime: ``local_device_count`` runs in the ``deepspeed`` launcher,
and ``configure_process`` must finish before the worker's first device use.
"""
import glob
import os
import re
import warnings
from typing import TYPE_CHECKING, Dict, List, Mapping, MutableMapping, Optional, Tuple

from deepspeed_xla import xla_runtime
from deepspeed_xla.devices.base import DeviceType

if TYPE_CHECKING:
    from tpu_info.device import TpuChip

TPU_BASE_PORT = 8476
GOOGLE_PCI_VENDOR = "0x1ae0"
PCI_DEVICES = "/sys/bus/pci/devices"
# The PCI device ids tpu-info maps to TPU chips (v2/v3, v4, v5p, v5e, v6e, 7x), for hosts without tpu-info.
TPU_PCI_DEVICE_IDS = frozenset({"0x0027", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})
# Peak dense bf16 TFLOP/s per chip (Cloud TPU system-architecture pages), keyed by tpu-info's chip name.
PEAK_BF16_TFLOPS_PER_CHIP = {"v4": 275, "v5e": 197, "v5p": 459, "v6e": 918, "7x": 2307}


class TpuDevice(DeviceType):
    pjrt_name = "TPU"
    visible_devices_env = "TPU_VISIBLE_CHIPS"
    has_xla_collectives = True
    comm_backend = "xla_ds"
    unverified = ("not yet run on TPU hardware: the per-process topology is tested against torch_xla's own code "
                  "on faked hosts, training runs on PJRT CPU (docs/pipeline.md, README Status)")

    def is_present(self) -> bool:
        return self.local_device_count() > 0

    def local_device_count(self, env: Mapping[str, str] = os.environ) -> int:
        """Chips on this host, from PCI (tpu-info); never the runtime."""
        return _pci_chips()[1]

    def describe(self) -> str:
        chip, count = _pci_chips()
        chips = f"{count} x {chip if chip is not None else 'Google PCI device (chip type: install tpu-info)'}"
        return f"{chips if count else 'no TPU chips on PCI'}; libtpu: {libtpu_path() or 'not found'}"

    def setup_problems(self) -> List[str]:
        chip, count = _pci_chips()
        problems = [] if count else ["PJRT_DEVICE=TPU but this host has no TPU chips on PCI: run on a Cloud TPU VM, "
                                     "or set PJRT_DEVICE=CPU."]
        if chip is not None:
            problems.append(unsupported_generation(int(re.match(r"v?(\d+)", chip.value.name).group(1))))
        if libtpu_path() is None:
            xla_version = xla_runtime.installed_version("torch_xla")
            pin = f"=={xla_runtime.base_version(xla_version)}" if xla_version else ""
            problems.append(f"libtpu (PJRT's TPU plugin) is not installed: pip install 'torch_xla[tpu]{pin}' (or set "
                            "TPU_LIBRARY_PATH to a libtpu.so).")
        return [problem for problem in problems if problem]

    def process_count_problem(self, processes: int, available: int) -> Optional[str]:
        """A slice runs one process per chip on every host (the topology libtpu is given counts them all);
        a lone process on a single host takes one chip."""
        if processes in (1, available):
            return None
        return (f"{processes} processes were requested on this host but it has {available} TPU chips, and a TPU "
                f"host runs one process per chip (or a single process on one chip): launch with deepspeed --num_gpus "
                f"{available} (in a hostfile: slots={available} for every host), or run 1 process.")

    def configure_process(self, local_rank, local_size, node_rank, env: MutableMapping[str, str]) -> None:
        chip = _own_chip(env.get(self.visible_devices_env, ""), local_rank)
        version, worker_ips = xla_runtime.tpu_version(), xla_runtime.tpu_worker_ips()
        if local_size == 1:
            computed = one_chip_env(chip, version, len(worker_ips))
        else:
            computed = tpu_process_env(local_rank, local_size, xla_runtime.tpu_env(), version, worker_ips, chip=chip)
        env[self.visible_devices_env] = computed.pop(self.visible_devices_env)
        computed.update(PJRT_LOCAL_PROCESS_RANK=str(local_rank), PJRT_LOCAL_PROCESS_COUNT=str(local_size))
        _replace_stale_topology(env, computed)

    def peak_bf16_flops(self) -> Optional[float]:
        """The chip's peak over its devices (TPU7x: two per chip, one process each); None without tpu-info."""
        chip, _ = _pci_chips()
        tflops = PEAK_BF16_TFLOPS_PER_CHIP.get(chip.value.name) if chip is not None else None
        return tflops * 1e12 / chip.value.devices_per_chip if tflops else None

    def export_env_prefixes(self):
        return super().export_env_prefixes() + ["TPU_", "LIBTPU_"]


def _pci_chips() -> Tuple[Optional["TpuChip"], int]:
    """tpu-info's PCI scan: (chip type, count); without tpu-info, the Google PCI devices whose id is a TPU chip's,
    and no type. No torch_xla import: this runs in every process that imports DeepSpeed with ``DS_ACCELERATOR``
    unset, so a failing scan is a warning and no chips, never an error of ``import deepspeed``."""
    try:
        from tpu_info import device
    except ImportError:
        return None, _tpu_ids_on_pci()
    try:
        chip_type, count = device.get_local_chips()
    except Exception as exc:  # noqa: BLE001 - tpu-info reads sysfs files that can vanish or be unreadable
        warnings.warn(f"deepspeed_xla: tpu-info could not scan this host's PCI devices ({type(exc).__name__}: "
                      f"{exc}); counting no TPU chips. Set DS_ACCELERATOR=xla and PJRT_DEVICE=TPU to use TPUs.")
        return None, 0
    return (chip_type, count) if chip_type is not None else (None, 0)


def _tpu_ids_on_pci() -> int:
    """Google PCI devices that are TPU chips: Google's gVNIC and Persistent Disk NVMe share the vendor id."""
    count = 0
    for folder in glob.glob(os.path.join(PCI_DEVICES, "*")):
        try:
            with open(os.path.join(folder, "vendor")) as vendor, open(os.path.join(folder, "device")) as device:
                count += vendor.read().strip() == GOOGLE_PCI_VENDOR and device.read().strip() in TPU_PCI_DEVICE_IDS
        except OSError:
            continue
    return count


def libtpu_path() -> Optional[str]:
    """Where torch_xla would load libtpu from, searched in its order ($TPU_LIBRARY_PATH, the copy bundled in
    torch_xla/lib, the libtpu package) without importing either package."""
    import importlib.util
    if os.environ.get("TPU_LIBRARY_PATH"):
        return os.environ["TPU_LIBRARY_PATH"]
    xla = importlib.util.find_spec("torch_xla")
    for folder in (xla.submodule_search_locations or []) if xla else []:
        if os.path.isfile(os.path.join(folder, "lib", "libtpu.so")):
            return os.path.join(folder, "lib", "libtpu.so")
    package = importlib.util.find_spec("libtpu")
    return os.path.join(os.path.dirname(package.origin), "libtpu.so") if package and package.origin else None


def unsupported_generation(tpu_version: int) -> Optional[str]:
    """Why this TPU generation cannot run one process per device (None when it can), naming the fix."""
    if tpu_version < 4:
        return (f"TPU v{tpu_version} runs two devices per chip and is not supported by deepspeed_xla's "
                "one-process-per-device model; use TPU v4 or newer.")
    return None


def _own_chip(visible: str, local_rank: int) -> int:
    """DeepSpeed's launch.py gives every rank the node's whole chip list; each rank takes its own."""
    chips = [c for c in visible.split(",") if c.strip()]
    if not chips:
        return local_rank
    if local_rank >= len(chips):
        raise RuntimeError(f"Local rank {local_rank} has no chip in TPU_VISIBLE_CHIPS={visible}: start at most "
                           f"{len(chips)} processes on this host (deepspeed --num_gpus {len(chips)}).")
    return int(chips[local_rank])


def one_chip_env(chip: int, tpu_version: int, hosts: int) -> Dict[str, str]:
    """The libtpu environment of a lone process on one chip (torch_xla's ``configure_one_chip_topology``, what
    ``xmp.spawn(nprocs=1)`` uses); a multi-host slice cannot run one process per host."""
    problem = unsupported_generation(tpu_version)
    if problem:
        raise RuntimeError(problem)
    if hosts > 1:
        raise RuntimeError(f"One process was started on this host of a {hosts}-host TPU slice, but a multi-host slice "
                           "runs one process per chip on every host: launch with deepspeed --num_gpus <chips per host> "
                           "(in the hostfile: slots=<chips per host> for every host).")
    return {"TPU_VISIBLE_CHIPS": str(chip), "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "1,1,1"}


#: What only a process of several on a host has: a lone process on one chip must not inherit them.
_MULTI_PROCESS_ONLY = ("CLOUD_TPU_TASK_ID", "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT")


def _replace_stale_topology(env: MutableMapping[str, str], computed: Mapping[str, str]) -> None:
    """Write this process's libtpu topology over whatever the environment held (torch_xla only sets defaults), naming
    each value replaced: one left by a single-process recipe or a .deepspeed_env makes libtpu start a slice of another
    shape, or wait for processes that never come."""
    stale = {key: env[key] for key in _MULTI_PROCESS_ONLY if key in env and key not in computed}
    stale.update({key: env[key] for key, value in computed.items() if env.get(key, value) != value})
    if stale:
        now = ", ".join(f"{key}={computed[key]!r}" if key in computed else f"{key} unset" for key in stale)
        warnings.warn("deepspeed_xla: replacing " + ", ".join(f"{key}={value!r}" for key, value in stale.items()) +
                      f" with this process's own topology ({now}): they were left in the environment by a "
                      "single-process recipe or a .deepspeed_env. Remove them from the environment and .deepspeed_env.")
    for key in stale:
        env.pop(key)
    env.update(computed)


def _bounds(text: str) -> List[int]:
    return [int(x) for x in text.split(",")]


def tpu_process_env(local_rank: int, local_size: int, tpu_env: Mapping[str, str], tpu_version: int,
                    worker_ips: List[str], base_port: int = TPU_BASE_PORT, chip: int = -1) -> Dict[str, str]:
    """The per-process libtpu environment for one chip per process (what ``xmp.spawn`` sets up).

    ``tpu_env`` is the TPU VM metadata (``torch_xla._internal.tpu.get_tpu_env()``).
    """
    problem = unsupported_generation(tpu_version)
    if problem:
        raise RuntimeError(problem)
    host_bounds = _bounds(tpu_env["TPU_PROCESS_BOUNDS"])
    chips_per_host = _bounds(tpu_env["TPU_CHIPS_PER_PROCESS_BOUNDS"])
    process_bounds = ",".join(str(h * c) for h, c in zip(host_bounds, chips_per_host))
    if tpu_version == 7:
        process_bounds += ",2"
    worker_id = int(tpu_env["WORKER_ID"])
    ports = range(base_port, base_port + local_size)
    addresses = ",".join(f"{ip}:{port}" for ip in worker_ips for port in ports)
    return {
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": process_bounds,
        "CLOUD_TPU_TASK_ID": str(worker_id * local_size + local_rank),
        "TPU_PROCESS_ADDRESSES": addresses,
        "TPU_VISIBLE_CHIPS": str(local_rank if chip < 0 else chip),
        "TPU_PROCESS_PORT": str(base_port + local_rank),
    }
