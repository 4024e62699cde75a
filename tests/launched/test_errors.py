"""Bad input gets one clear error that names the fix, from the process that found it: the errors of a worker and of
the runner that docs/bad_input.md lists beside tests/launched/test_bad_input.py's."""
from tests.conftest import VENV_BIN, clean_env
from tests.multiproc import last_error, run_command, run_python


def test_unknown_pjrt_device():
    proc = run_python("import deepspeed; from deepspeed.accelerator import get_accelerator; "
                      "get_accelerator().device_count()", DS_ACCELERATOR="xla", PJRT_DEVICE="GPU")
    assert "PJRT_DEVICE='GPU' is not supported by deepspeed_xla; set PJRT_DEVICE to one of TPU, CPU" in last_error(proc)


def test_device_used_before_per_process_setup():
    """``DS_ACCELERATOR=xla`` set only after torch_xla's import: nothing prepared the process, and the device was
    used before DeepSpeed."""
    code = ("import os, torch, torch_xla\n"
            "torch.ones(1, device=torch_xla.device()).cpu()\n"
            "os.environ['DS_ACCELERATOR'] = 'xla'\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "get_accelerator().set_device(0)\n")
    proc = run_python(code, LOCAL_RANK=0, LOCAL_SIZE=2, RANK=0, WORLD_SIZE=2)
    assert "before deepspeed_xla set up its per-process device topology" in last_error(proc)
    assert "call deepspeed_xla.setup_process() first" in last_error(proc)


def test_device_used_early_in_a_launched_worker():
    """A launched worker (here rank 1 of 2 on the host) sets its device up when it imports torch_xla: a library
    that uses the device before DeepSpeed (accelerate does, while the Trainer is built) starts PJRT with this
    process's one device, and DeepSpeed's device setup then goes on from there."""
    code = ("import os, torch, torch_xla, torch_xla.core.xla_model as xm\n"
            "torch.ones(1, device=torch_xla.device()).cpu()\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "get_accelerator().set_device(1)\n"
            "print(len(xm.get_xla_supported_devices()), os.environ['PJRT_LOCAL_PROCESS_RANK'],"
            " os.environ['PJRT_LOCAL_PROCESS_COUNT'])\n")
    proc = run_python(code, DS_ACCELERATOR="xla", LOCAL_RANK=1, LOCAL_SIZE=2, RANK=1, WORLD_SIZE=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1", "1", "2"]


def test_malformed_deepspeed_env_line_stops_the_runner(tmp_path):
    (tmp_path / ".deepspeed_env").write_text("DS_ACCELERATOR=xla\nnot a setting\n")
    proc = run_command([str(VENV_BIN / "deepspeed"), "--num_gpus", "1", "x.py"], 300, cwd=tmp_path,
                       env=clean_env(HOME=tmp_path))
    assert ".deepspeed_env:2: 'not a setting' is not a NAME=value line" in last_error(proc)
