"""Cloud TPU: chips found on PCI, one process per chip, torch_xla's ``xla`` process group.

Nothing here may start the PJRT runtime: ``local_device_count`` runs in the ``deepspeed`` launcher,
and ``configure_process`` must finish before the worker's first device use.
"""
from typing import Dict, List, Mapping, MutableMapping

from deepspeed_xla.devices.base import DeviceType

TPU_BASE_PORT = 8476
GOOGLE_PCI_VENDOR = "0x1ae0"


class TpuDevice(DeviceType):
    pjrt_name = "TPU"
    visible_devices_env = "TPU_VISIBLE_CHIPS"
    has_xla_collectives = True

    def is_present(self) -> bool:
        return self._pci_chip_count() > 0

    def local_device_count(self) -> int:
        """Chips on this host, from PCI (tpu-info); never the runtime."""
        return self._pci_chip_count()

    @staticmethod
    def _pci_chip_count() -> int:
        """tpu-info's PCI scan; without tpu-info, Google-vendor PCI devices (no torch_xla import: this
        runs in every process that imports DeepSpeed with ``DS_ACCELERATOR`` unset)."""
        try:
            from tpu_info import device
            chip_type, count = device.get_local_chips()
            return count if chip_type is not None else 0
        except ImportError:
            import glob
            vendors = glob.glob("/sys/bus/pci/devices/*/vendor")
            return sum(1 for path in vendors if open(path).read().strip() == GOOGLE_PCI_VENDOR)

    def configure_process(self, local_rank, local_size, node_rank, env: MutableMapping[str, str]) -> None:
        from torch_xla._internal import tpu
        chip = _own_chip(env.get(self.visible_devices_env, ""), local_rank)
        computed = tpu_process_env(local_rank, local_size, tpu.get_tpu_env(), tpu.version(),
                                   tpu.get_worker_ips(), chip=chip)
        env[self.visible_devices_env] = computed.pop(self.visible_devices_env)
        for key, value in computed.items():
            env.setdefault(key, value)
        env.setdefault("PJRT_LOCAL_PROCESS_RANK", str(local_rank))
        env.setdefault("PJRT_LOCAL_PROCESS_COUNT", str(local_size))

    def communication_backend(self) -> str:
        from deepspeed_xla.comm import xla_collectives
        xla_collectives.register()
        return xla_collectives.BACKEND_NAME

    def export_env_prefixes(self):
        return super().export_env_prefixes() + ["TPU_", "LIBTPU_"]


def _own_chip(visible: str, local_rank: int) -> int:
    """DeepSpeed's launch.py gives every rank the node's whole chip list; each rank takes its own."""
    chips = [c for c in visible.split(",") if c.strip()]
    if not chips:
        return local_rank
    if local_rank >= len(chips):
        raise RuntimeError(f"Local rank {local_rank} has no chip in TPU_VISIBLE_CHIPS={visible}: start at most "
                           f"{len(chips)} processes on this host (deepspeed --num_gpus {len(chips)}).")
    return int(chips[local_rank])


def _bounds(text: str) -> List[int]:
    return [int(x) for x in text.split(",")]


def tpu_process_env(local_rank: int, local_size: int, tpu_env: Mapping[str, str], tpu_version: int,
                    worker_ips: List[str], base_port: int = TPU_BASE_PORT, chip: int = -1) -> Dict[str, str]:
    """The per-process libtpu environment for one chip per process (what ``xmp.spawn`` sets up).

    ``tpu_env`` is the TPU VM metadata (``torch_xla._internal.tpu.get_tpu_env()``).
    """
    if tpu_version < 4:
        raise RuntimeError(
            f"TPU v{tpu_version} runs two devices per chip and is not supported by deepspeed_xla's "
            "one-process-per-device model; use TPU v4 or newer.")
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
