"""deepspeed_xla: DeepSpeed on XLA devices (TPU; PJRT CPU for development and CI).

Importing this package is cheap: the heavy names load on first access, because the startup hook
imports it in every Python process.
"""
__version__ = "0.1.0"

_LAZY = {
    "XLA_Accelerator": ("deepspeed_xla.accelerator", "XLA_Accelerator"),
    "register": ("deepspeed_xla.registration", "register"),
    "setup_process": ("deepspeed_xla.process_setup", "setup_process"),
}

__all__ = list(_LAZY) + ["__version__"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'deepspeed_xla' has no attribute {name!r}")
    import importlib
    module_name, attr = _LAZY[name]
    return getattr(importlib.import_module(module_name), attr)
