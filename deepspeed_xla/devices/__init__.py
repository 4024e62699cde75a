"""Device types behind one interface; ``current_device_type()`` is the only entry point."""
import os
import warnings
from typing import Dict, Type

from deepspeed_xla.devices.base import DeviceType
from deepspeed_xla.devices.cpu import CpuDevice
from deepspeed_xla.devices.tpu import TpuDevice

DEVICE_TYPES: Dict[str, Type[DeviceType]] = {cls.pjrt_name: cls for cls in (TpuDevice, CpuDevice)}

_current = None


def current_device_type() -> DeviceType:
    """The device type named by ``PJRT_DEVICE``; when unset, TPU if chips are on PCI, else CPU.

    The choice is written back to ``PJRT_DEVICE`` so that the launcher's children agree with it.
    """
    global _current
    name = os.environ.get("PJRT_DEVICE", "").strip().upper()
    if _current is not None and _current.pjrt_name == name:
        return _current
    if not name:
        name = "TPU" if TpuDevice().is_present() else "CPU"
        if name == "CPU":
            warnings.warn("deepspeed_xla: PJRT_DEVICE is unset and this host has no TPU chips, so XLA runs on "
                          "PJRT CPU. Set PJRT_DEVICE=CPU to silence this, or PJRT_DEVICE=TPU on a TPU host.")
        os.environ["PJRT_DEVICE"] = name
    if name not in DEVICE_TYPES:
        raise ValueError(f"PJRT_DEVICE={os.environ['PJRT_DEVICE']!r} is not supported by deepspeed_xla; set "
                         f"PJRT_DEVICE to one of {', '.join(DEVICE_TYPES)} (or unset it to pick TPU when chips "
                         "are present, else CPU).")
    _current = DEVICE_TYPES[name]()
    return _current
