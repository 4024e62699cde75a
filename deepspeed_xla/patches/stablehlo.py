"""torch_xla's ``stablehlo`` (model export) module, loaded when something first uses it.

``import torch_xla`` imports its StableHLO exporter, which imports torch_xla's dynamo bridge and with it torch's
inductor: ~1.5 s of CPU in every worker (figures: docs/performance.md), for an API no training run calls. Before
torch_xla's own import runs, ``defer`` puts a stand-in under the module's name. It carries the two functions
torch_xla re-exports (``STAND_IN_NAMES``, forwarding their calls); any other attribute, or a call, imports the real
module, which replaces the stand-in in ``sys.modules`` and on the package. Imports neither torch nor torch_xla:
this runs inside the import of torch_xla.
"""
import importlib
import importlib.machinery
import sys
import threading
import types
from importlib import metadata

from deepspeed_xla import xla_runtime
from deepspeed_xla.patches.registry import VERSIONS

MODULE = "torch_xla.stablehlo"
#: What torch_xla/__init__.py imports from the module (tests/patches/test_stablehlo.py reads it there).
STAND_IN_NAMES = ("save_as_stablehlo", "save_torch_model_as_stablehlo")
_lock = threading.RLock()  # re-entered if the real module, while loading, reads an attribute of the stand-in


class _StandIn(types.ModuleType):

    def __getattr__(self, name: str):
        if name.startswith("__"):  # module introspection (inspect.getmodule scans every module's __file__)
            raise AttributeError(name)
        return getattr(_real(), name)


def _real() -> types.ModuleType:
    with _lock:
        module = sys.modules.get(MODULE)
        if isinstance(module, _StandIn):
            del sys.modules[MODULE]
            try:
                module = importlib.import_module(MODULE)
            except BaseException:
                sys.modules[MODULE] = _stand_in
                raise
        return module


def _forwarder(name: str):

    def forward(*args, **kwargs):
        return getattr(_real(), name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__module__ = MODULE
    return forward


_stand_in = _StandIn(MODULE, "Stand-in for torch_xla.stablehlo until first use (deepspeed_xla.patches.stablehlo).")
for _name in STAND_IN_NAMES:
    setattr(_stand_in, _name, _forwarder(_name))


def defer(torch_xla: types.ModuleType) -> None:
    """Startup-hook entry, before torch_xla's body runs: the stand-in, for the torch_xla release it was written for
    and when the XLA accelerator is DeepSpeed's (other processes import torch_xla unchanged)."""
    from deepspeed_xla.devices import wants_xla
    if (MODULE in sys.modules or not wants_xla()
            or xla_runtime.base_version(metadata.version("torch_xla")) != VERSIONS["torch_xla"]):
        return
    _stand_in.__spec__ = importlib.machinery.PathFinder.find_spec(MODULE, torch_xla.__path__)
    _stand_in.__file__ = _stand_in.__spec__.origin
    sys.modules[MODULE] = _stand_in
    torch_xla.stablehlo = _stand_in
