"""What differs between kinds of XLA device, and nothing else.

Every device-type difference (how to count devices without starting PJRT, the per-process
environment, the comm backend, dtypes, memory figures) is a method here. Modules above this layer
never branch on the device type: they are handed this process's ``current_device_type()``.
"""
from abc import ABC, abstractmethod
import os
from typing import Dict, List, Mapping, MutableMapping, Optional


class DeviceType(ABC):
    """One PJRT device type (``PJRT_DEVICE`` value), e.g. CPU or TPU."""

    #: The ``PJRT_DEVICE`` value this class serves.
    pjrt_name: str = ""
    #: The per-node variable the ``deepspeed`` runner reads as ``--include localhost:<value>``.
    visible_devices_env: str = ""
    #: Whether XLA itself connects the processes (then PJRT needs the multi-process topology).
    has_xla_collectives: bool = False
    #: Whether device buffers are host memory that gloo can read and fill directly (DLPack, no copies).
    host_addressable: bool = False
    #: The torch.distributed backend (``deepspeed_xla.comm.backends.BACKENDS``) that processes of this type use.
    comm_backend: str = ""

    @abstractmethod
    def is_present(self) -> bool:
        """True when this host has such devices; must not start the XLA runtime."""

    @abstractmethod
    def local_device_count(self, env: Mapping[str, str] = os.environ) -> int:
        """Devices on this host (= processes the launcher may start), with the device variables of ``env``; must
        not start the runtime."""

    def describe(self) -> str:
        """What this host has of this device type, in a few words for ``ds_xla_report``; never starts the runtime."""
        return f"{self.local_device_count()} {self.pjrt_name} device(s)"

    #: What has not been run on real hardware of this type, or "" when CI runs it all; the report shows it.
    unverified: str = ""

    def setup_problems(self) -> List[str]:
        """Why this host cannot run this device type, each naming the fix (empty when it can); never starts the
        runtime. ``ds_xla_report`` prints them."""
        return []

    def too_few_devices_hint(self) -> str:
        """How to get more devices, for the error when a host is asked for more processes than it has."""
        return "or use a host with more devices"

    def process_count_problem(self, processes: int, available: int) -> Optional[str]:
        """Why a host with ``available`` devices cannot run ``processes`` workers (one device each), naming
        the fix; None when it can. Default: any number up to one per device."""
        if processes <= available:
            return None
        return (f"{processes} processes were requested on this host but it has {available} {self.pjrt_name} "
                f"device(s): launch with deepspeed --num_gpus {available} or fewer (in a hostfile: slots={available} "
                f"or fewer for this host), {self.too_few_devices_hint()}.")

    @abstractmethod
    def configure_process(self, local_rank: int, local_size: int, node_rank: int,
                          env: MutableMapping[str, str]) -> None:
        """Write this process's PJRT topology into ``env`` before the runtime starts."""

    def prepare_runtime(self) -> None:
        """Last step of a worker's setup, after ``configure_process`` and ``import torch_xla``, before any
        device use: e.g. register the PJRT plugin that serves this device type. Default: nothing."""

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return False

    def is_fp64_supported(self) -> bool:
        return False

    def memory_info(self, device) -> Optional[Dict[str, int]]:
        """``{bytes_used, bytes_limit, peak_bytes_used}`` from the runtime, or None if it has none."""
        from deepspeed_xla import xla_runtime
        try:
            return dict(xla_runtime.memory_info(device))
        except (RuntimeError, NotImplementedError):
            return None

    def peak_bf16_flops(self) -> Optional[float]:
        """Peak dense bf16 FLOP/s of one device (= one process), for MFU; None when unknown or meaningless."""
        return None

    def export_env_prefixes(self) -> List[str]:
        """Variable-name prefixes the multi-node runner forwards to other hosts."""
        return ["PJRT_", "XLA_", "DS_XLA_", "DS_ACCELERATOR"]
