"""Device types behind one interface, and the one decision of which type this process runs on.

``current_device_type()`` makes that decision from ``PJRT_DEVICE`` (unset: TPU when chips are on PCI,
else CPU) and the accelerator hands the result down; ``host_has_tpu()`` is the one PCI scan, which
also decides whether an unset ``DS_ACCELERATOR`` means XLA. Nothing here starts the XLA runtime.
"""
import functools
import os
import warnings
from typing import Dict, Type

from deepspeed_xla.bootstrap import ACCELERATOR_NAME
from deepspeed_xla.devices.base import DeviceType
from deepspeed_xla.devices.cpu import CpuDevice
from deepspeed_xla.devices.cuda import CudaDevice
from deepspeed_xla.devices.tpu import TpuDevice

__all__ = ["DEVICE_TYPES", "DeviceType", "UNSET_ON_CPU_WARNING", "current_device_type", "default_device_name",
           "device_type_named", "host_has_tpu", "wants_xla"]

DEVICE_TYPES: Dict[str, Type[DeviceType]] = {cls.pjrt_name: cls for cls in (TpuDevice, CpuDevice, CudaDevice)}

# Said when an unset PJRT_DEVICE falls back to CPU (by current_device_type() and by ds_xla_report).
UNSET_ON_CPU_WARNING = ("deepspeed_xla: PJRT_DEVICE is unset and this host has no TPU chips, so XLA runs on PJRT CPU. "
                        "Set PJRT_DEVICE=CPU to silence this, PJRT_DEVICE=TPU on a TPU host, or PJRT_DEVICE=CUDA on "
                        "a GPU host.")

_current = None


@functools.lru_cache(maxsize=None)
def host_has_tpu() -> bool:
    """Whether TPU chips are on this host's PCI bus (never starts the runtime; scanned once per process)."""
    return TpuDevice().is_present()


def wants_xla() -> bool:
    """Whether DeepSpeed's accelerator here is XLA: ``DS_ACCELERATOR=xla``; or, with it unset, a host that really
    has TPU chips."""
    requested = os.environ.get("DS_ACCELERATOR", "").strip().lower()
    if requested:
        return requested == ACCELERATOR_NAME
    return host_has_tpu()


def default_device_name() -> str:
    """What an unset ``PJRT_DEVICE`` means: TPU when chips are on PCI, else CPU."""
    return "TPU" if host_has_tpu() else "CPU"


def device_type_named(value: str) -> DeviceType:
    """The device type for a ``PJRT_DEVICE`` value; an unknown value is an error that names the choices."""
    name = value.strip().upper()
    if name not in DEVICE_TYPES:
        raise ValueError(f"PJRT_DEVICE={value!r} is not supported by deepspeed_xla; set PJRT_DEVICE to one of "
                         f"{', '.join(DEVICE_TYPES)} (or unset it to pick TPU when chips are present, else CPU).")
    return DEVICE_TYPES[name]()


def current_device_type() -> DeviceType:
    """This process's device type, named by ``PJRT_DEVICE``; when unset, TPU if chips are on PCI, else CPU.

    The choice is written back to ``PJRT_DEVICE`` so that the launcher's children agree with it; it is made
    again only if ``PJRT_DEVICE`` changes before the runtime starts.
    """
    global _current
    name = os.environ.get("PJRT_DEVICE", "").strip().upper()
    if _current is not None and _current.pjrt_name == name:
        return _current
    if not name:
        name = default_device_name()
        if name == "CPU":
            warnings.warn(UNSET_ON_CPU_WARNING)
        os.environ["PJRT_DEVICE"] = name
    _current = device_type_named(os.environ["PJRT_DEVICE"])
    return _current
