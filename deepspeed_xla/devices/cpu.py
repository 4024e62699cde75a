"""PJRT CPU: the development and CI device. No cross-process XLA collectives exist here."""
import os
from typing import MutableMapping

from deepspeed_xla.devices.base import DeviceType, cpu_count, int_env


class CpuDevice(DeviceType):
    pjrt_name = "CPU"
    host_addressable = True
    visible_devices_env = "DS_XLA_VISIBLE_DEVICES"

    def is_present(self) -> bool:
        return True

    def local_device_count(self) -> int:
        """``CPU_NUM_DEVICES`` if set (to run more processes than cores), else one per core."""
        return int_env(os.environ, "CPU_NUM_DEVICES") or cpu_count()

    def describe(self) -> str:
        source = ("from CPU_NUM_DEVICES" if int_env(os.environ, "CPU_NUM_DEVICES")
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
        """None without asking: PJRT CPU keeps no allocator statistics, and the refusal (an exception) cost
        ZeRO-3, which reads memory stats every step, 0.4 ms a step."""
        return None

    def communication_backend(self) -> str:
        from deepspeed_xla.comm.host_staged import BACKEND_NAME
        return BACKEND_NAME

    def export_env_prefixes(self):
        return super().export_env_prefixes() + ["CPU_NUM_DEVICES"]
