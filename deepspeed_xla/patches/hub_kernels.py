"""Patch of transformers' hub-kernels integration (``transformers.integrations.hub_kernels``): off on XLA.

From 5.25 transformers kernelizes every model it loads (``use_kernels`` defaults to on) and again whenever
``model.train()`` or ``model.eval()`` changes the mode, through the ``kernels`` package, which it now requires. The
``kernels`` package serves CUDA, ROCm, XPU, MPS, NPU, Neuron, TorchTPU and CPU layers, and refuses an ``xla``
device (``ValueError: Unsupported device type 'xla'``, from the Trainer's ``model.train()``); a layer it swapped
in on the host before the model moved to XLA would be a kernel of another device. On XLA the integration is off,
as ``USE_HUB_KERNELS=NO`` turns it off: models keep their torch layers, which XLA compiles.
"""
import functools


def disabled_on_xla(original):
    """``_kernels_enabled`` (``USE_HUB_KERNELS``, default on) that answers no: applied only to XLA runs."""

    @functools.wraps(original)
    def _kernels_enabled() -> bool:
        return False

    return _kernels_enabled
