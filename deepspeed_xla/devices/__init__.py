"""Device types behind one interface; ``current_device_type()`` is the only entry point."""
import os
import warnings
from typing import Dict, Type

from deepspeed_xla.devices.base import DeviceType
from deepspeed_xla.devices.cpu import CpuDevice
from deepspeed_xla.devices.cuda import CudaDevice
from deepspeed_xla.devices.tpu import TpuDevice

DEVICE_TYPES: Dict[str, Type[DeviceType]] = {cls.pjrt_name: cls for cls in (TpuDevice, CpuDevice, CudaDevice)}

_current = None


# Said when an unset PJRT_DEVICE falls back to CPU (by current_device_type() and by ds_xla_report).
UNSET_ON_CPU_WARNING = ("deepspeed_xla: PJRT_DEVICE is unset and this host has no TPU chips, so XLA runs on PJRT CPU. "
                        "Set PJRT_DEVICE=CPU to silence this, PJRT_DEVICE=TPU on a TPU host, or PJRT_DEVICE=CUDA on "
                        "a GPU host.")


def default_device_name() -> str:
    """What an unset ``PJRT_DEVICE`` means: TPU when chips are on PCI, else CPU (never starts the runtime)."""
    return "TPU" if TpuDevice().is_present() else "CPU"


def device_type_named(value: str) -> DeviceType:
    """The device type for a ``PJRT_DEVICE`` value; an unknown value is an error that names the choices."""
    name = value.strip().upper()
    if name not in DEVICE_TYPES:
        raise ValueError(f"PJRT_DEVICE={value!r} is not supported by deepspeed_xla; set PJRT_DEVICE to one of "
                         f"{', '.join(DEVICE_TYPES)} (or unset it to pick TPU when chips are present, else CPU).")
    return DEVICE_TYPES[name]()


def current_device_type() -> DeviceType:
    """The device type named by ``PJRT_DEVICE``; when unset, TPU if chips are on PCI, else CPU.

    The choice is written back to ``PJRT_DEVICE`` so that the launcher's children agree with it.
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
