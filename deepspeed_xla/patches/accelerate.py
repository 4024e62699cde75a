"""Patches of accelerate's DeepSpeed integration: which distributed mode a DeepSpeed run takes
(``accelerate.state``), and the gradient norm it hands the Trainer (``accelerate.utils.deepspeed``).

accelerate takes torch_xla's own mode (``DistributedType.XLA``) whenever torch_xla is importable, before it looks
at DeepSpeed: it starts the XLA runtime while the Trainer is built (``xm.set_replication``), counts one process per
PJRT CPU rank, and on a TPU never selects the DeepSpeed plugin, so the DeepSpeed config would be dropped.
"""
import functools
import os
from typing import Optional

from deepspeed_xla.patches.registry import requirement

#: DeepSpeed accelerator name -> the accelerate ``DistributedType`` whose ``set_device`` takes that accelerator's
#: device. The tests' reference runs add DeepSpeed's CPU accelerator (``MULTI_CPU``), which accelerate never gives
#: to DeepSpeed either.
DISTRIBUTED_TYPES = {"xla": "XLA"}


def _served_type(cpu: bool) -> Optional[str]:
    """The ``DISTRIBUTED_TYPES`` entry of DeepSpeed's accelerator when accelerate was asked for DeepSpeed
    (``ACCELERATE_USE_DEEPSPEED``, set by ``accelerate launch`` and by ``TrainingArguments(deepspeed=...)``)."""
    if cpu or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    from deepspeed.accelerator import get_accelerator
    return DISTRIBUTED_TYPES.get(get_accelerator().device_name())


def prepare_backend(original):
    """Under DeepSpeed on XLA, hand accelerate DeepSpeed's backend as for a GPU: accelerate then runs
    ``deepspeed.init_distributed`` (this package's per-process device set-up comes first), takes its world from
    torch.distributed, and ends in its DeepSpeed mode. The type it gets, ``XLA``, only makes its ``set_device`` take
    the XLA device; accelerate replaces it with ``DEEPSPEED`` before anything else reads it."""

    @functools.wraps(original)
    def _prepare_backend(self, cpu: bool = False, sagemaker_dp=False, backend=None):
        served = None if sagemaker_dp else _served_type(cpu)
        if served is None:
            return original(self, cpu, sagemaker_dp, backend)
        from accelerate.utils import DistributedType
        from deepspeed.accelerator import get_accelerator
        return get_accelerator().communication_backend_name(), DistributedType[served]

    return _prepare_backend


def refuses_dropped_deepspeed(original):
    """``AcceleratorState`` that stops, naming why, when DeepSpeed was asked for on XLA and accelerate chose another
    mode: training on without the DeepSpeed config (another optimizer, no ZeRO) must never happen silently."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from accelerate.utils import DistributedType
        if self.distributed_type != DistributedType.DEEPSPEED and _served_type(self._cpu):
            raise RuntimeError(
                f"accelerate was asked for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true) but chose "
                f"{self.distributed_type}, "
                "so the DeepSpeed config would not be used. deepspeed_xla patches accelerate's choice for the "
                f"accelerate releases it is tested with: pip install '{requirement('accelerate')}', or report this "
                "accelerate version.")

    return __init__


def grad_norm_on_device(original):
    """``DeepSpeedEngineWrapper.get_global_grad_norm`` returns the engine's norm as the tensor it is (as torch's
    ``clip_grad_norm_`` does) instead of reading it with ``.item()`` after every optimizer step: on XLA that read
    waits for the step's graph to run. The Trainer reads it when it logs it."""

    @functools.wraps(original)
    def get_global_grad_norm(self):
        return self.engine.get_global_grad_norm()

    return get_global_grad_norm
