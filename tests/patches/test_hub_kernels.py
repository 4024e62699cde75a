"""``patches/hub_kernels.py``: in an XLA run transformers loads and trains a model without its hub kernels, which
cannot serve an XLA device; with the patch undone the Trainer's first ``model.train()`` fails."""
from tests.multiproc import last_error, run_python

# A model saved and loaded as a user's script does, moved to this process's XLA device and put in training mode (what
# the Trainer does first); ``undo``: transformers' own switch back, in both modules that hold it.
TRAIN_MODE_ON_XLA = """
import inspect, json, sys, tempfile
import transformers.modeling_utils as modeling_utils
from transformers.integrations import hub_kernels
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from deepspeed_xla import xla_runtime
if sys.argv[1] == "undo":
    hub_kernels._kernels_enabled = modeling_utils._kernels_enabled = inspect.unwrap(hub_kernels._kernels_enabled)
folder = tempfile.mkdtemp()
GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)).save_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder).to(xla_runtime.device())
model.train()
print(json.dumps({"use_kernels": model.use_kernels, "device": str(next(model.parameters()).device)}))
"""


def test_models_train_on_xla_without_hub_kernels():
    proc = run_python(TRAIN_MODE_ON_XLA, "patched", DS_ACCELERATOR="xla")
    assert proc.returncode == 0, last_error(proc)
    assert proc.stdout.strip().splitlines()[-1] == '{"use_kernels": false, "device": "xla:0"}'


def test_without_the_patch_kernels_refuses_the_xla_device():
    proc = run_python(TRAIN_MODE_ON_XLA, "undo", DS_ACCELERATOR="xla")
    assert proc.returncode != 0
    assert "Unsupported device type 'xla'" in last_error(proc)
