"""``patches/accelerate.py``: a DeepSpeed run that accelerate would take out of DeepSpeed stops instead."""
from deepspeed_xla.patches.registry import requirement
from tests.multiproc import last_error, run_python

# accelerate's own backend choice (the patch undone) on a host accelerate takes for a TPU VM: its XLA mode, in which
# the DeepSpeed plugin is never selected and the Trainer would build its own optimizer.
UNPATCHED_ON_A_TPU = """
import inspect
import accelerate.state as state
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
real = state.is_torch_xla_available
state.is_torch_xla_available = lambda check_is_tpu=False, check_is_gpu=False: True if check_is_tpu else real()
state.PartialState._prepare_backend = inspect.unwrap(state.PartialState._prepare_backend)
Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 1,
                                                           "zero_optimization": {"stage": 2}}))
print("trained without DeepSpeed")
"""


def test_deepspeed_dropped_by_accelerate_stops_the_run():
    proc = run_python(UNPATCHED_ON_A_TPU, DS_ACCELERATOR="xla", ACCELERATE_USE_DEEPSPEED="true")
    assert "trained without DeepSpeed" not in proc.stdout
    error = last_error(proc)
    assert "accelerate was asked for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true) but chose DistributedType.XLA" in error
    assert f"pip install '{requirement('accelerate')}'" in error
