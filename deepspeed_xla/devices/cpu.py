"""PJRT CPU: the development and CI device. No cross-process XLA collectives exist here."""
import os
from typing import Mapping, MutableMapping

from deepspeed_xla import env_vars
from deepspeed_xla.devices.base import DeviceType


class CpuDevice(DeviceType):
    pjrt_name = "CPU"
    host_addressable = True
    comm_backend = "xla_host"
    visible_devices_env = "DS_XLA_VISIBLE_DEVICES"

    def is_present(self) -> bool:
        return True

    def local_device_count(self, env: Mapping[str, str] = os.environ) -> int:
        """``CPU_NUM_DEVICES`` if set (to run more processes than cores), else one per core."""
        return env_vars.positive_int(env, "CPU_NUM_DEVICES") or cpu_count()

    def describe(self) -> str:
        source = ("from CPU_NUM_DEVICES" if env_vars.positive_int(os.environ, "CPU_NUM_DEVICES")
                  else "one per core; CPU_NUM_DEVICES sets another count")
        return f"{self.local_device_count()} PJRT CPU device(s) ({source})"

    def too_few_devices_hint(self) -> str:
        return "or set CPU_NUM_DEVICES to run more PJRT CPU processes than cores"

    def configure_process(self, local_rank, local_size, node_rank, env: MutableMapping[str, str]) -> None:
        # One process drives one device; CPU_NUM_DEVICES may have been set for the launcher's count.
        env["CPU_NUM_DEVICES"] = "1"
        env.setdefault("PJRT_LOCAL_PROCESS_RANK", str(local_rank))
        env.setdefault("PJRT_LOCAL_PROCESS_COUNT", str(local_size))

    def memory_info(self, device) -> None:
        """None without asking: PJRT CPU keeps no allocator statistics, and asking raises, which costs ZeRO-3
        (it reads memory stats every step) host time (docs/performance.md, 'Figures behind the code')."""
        return None

    def export_env_prefixes(self):
        return super().export_env_prefixes() + ["CPU_NUM_DEVICES"]


def cpu_count() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
