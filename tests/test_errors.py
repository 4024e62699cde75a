"""Bad input gets one clear error that names the fix, from the process that found it."""
import subprocess
import sys
from importlib import metadata

import pytest

from deepspeed_xla import xla_runtime
from tests.conftest import clean_env


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=clean_env(**env), capture_output=True, text=True,
                          timeout=300)


def _last_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, proc.stdout
    return proc.stderr.strip().splitlines()[-1]


def test_missing_torch_xla(monkeypatch):

    def version(name):
        if name == "torch_xla":
            raise metadata.PackageNotFoundError(name)
        return "2.9.0"

    monkeypatch.setattr(xla_runtime.metadata, "version", version)
    with pytest.raises(ImportError, match=r"needs torch_xla installed: pip install torch==2.9.0 torch_xla==2.9.0"):
        xla_runtime.torch_xla.__wrapped__()


def test_torch_and_torch_xla_mismatch(monkeypatch):
    monkeypatch.setattr(xla_runtime.metadata, "version", lambda name: {"torch": "2.8.0+cu128"}.get(name, "2.9.0"))
    with pytest.raises(ImportError, match=r"not a matching pair .* pip install torch==2\.9\.0 or torch_xla==2\.8\.0"):
        xla_runtime.torch_xla.__wrapped__()


def test_unknown_pjrt_device():
    proc = _run("import deepspeed; from deepspeed.accelerator import get_accelerator; get_accelerator().device_count()",
                DS_ACCELERATOR="xla", PJRT_DEVICE="GPU")
    assert "PJRT_DEVICE='GPU' is not supported by deepspeed_xla; set PJRT_DEVICE to one of TPU, CPU" in _last_error(proc)


def test_device_used_before_per_process_setup():
    code = ("import torch, torch_xla, deepspeed\n"
            "torch.ones(1, device=torch_xla.device()).cpu()\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "get_accelerator().set_device(0)\n")
    proc = _run(code, DS_ACCELERATOR="xla", LOCAL_RANK=0, LOCAL_SIZE=2, RANK=0, WORLD_SIZE=2)
    assert "before deepspeed_xla set up its per-process device topology" in _last_error(proc)
    assert "call deepspeed_xla.setup_process() first" in _last_error(proc)


def test_more_processes_than_devices():
    code = "import deepspeed\nfrom deepspeed.accelerator import get_accelerator\nget_accelerator().set_device(0)\n"
    proc = _run(code, DS_ACCELERATOR="xla", LOCAL_RANK=0, LOCAL_SIZE=3, CPU_NUM_DEVICES=2)
    error = _last_error(proc)
    assert "3 processes were requested on this host but it has 2 CPU device(s)" in error
    assert "deepspeed --num_gpus 2" in error and "CPU_NUM_DEVICES" in error


def test_malformed_deepspeed_env_line_stops_the_runner(tmp_path):
    (tmp_path / ".deepspeed_env").write_text("DS_ACCELERATOR=xla\nnot a setting\n")
    proc = subprocess.run([str(clean_env()["PATH"].split(":")[0] + "/deepspeed"), "--num_gpus", "1", "x.py"],
                          cwd=tmp_path, env=clean_env(HOME=tmp_path), capture_output=True, text=True, timeout=300)
    assert ".deepspeed_env:2: 'not a setting' is not a NAME=value line" in _last_error(proc)
