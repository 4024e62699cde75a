"""The wheels of the ``[cuda]`` extra, pinned once: JAX's CUDA PJRT plugin and CUDA's compiler tools.

Standard library only: ``setup.py`` loads this file by path for its ``cuda`` extra, before the package's
dependencies exist; ``scripts/run_tests.sh`` installs ``requirements()`` beside the venv for the CUDA tests
alone; ``plugin`` names the pins in its errors. The CPU venv (``requirements.txt``) holds neither wheel.
"""
from typing import List

PLUGIN_DISTRIBUTION = "jax-cuda12-pjrt"
PLUGIN_VERSION = "0.7.1"  # the JAX release torch_xla 2.9 pins for Pallas: the same XLA era
#: CUDA's ptxas and libdevice, which XLA needs to compile kernels; torch's CUDA wheels do not bring them.
TOOLKIT_DISTRIBUTION = "nvidia-cuda-nvcc-cu12"
TOOLKIT_VERSION = "12.8.93"  # the CUDA 12.8 of torch 2.9.0's CUDA libraries


def requirements() -> List[str]:
    """The ``cuda`` extra: both wheels, pinned."""
    return [f"{PLUGIN_DISTRIBUTION}=={PLUGIN_VERSION}", f"{TOOLKIT_DISTRIBUTION}=={TOOLKIT_VERSION}"]
