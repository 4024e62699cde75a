"""docs/bad_input.md, row by row: each misconfiguration either works or fails with one error that names the fix.

Rows covered by tests/launched/test_errors.py (unknown PJRT_DEVICE, malformed .deepspeed_env, the device used before the
per-process setup) are referenced from the table, not repeated; a launcher's check and the worker's that gives the
same error are one test. Config rows parse a ``DeepSpeedConfig`` in this process:
that is where ``deepspeed.initialize`` refuses them, before it touches the device. The rows about ranks once they run:
test_bad_input_ranks.py.
"""
import base64
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from deepspeed_xla import xla_runtime
from deepspeed_xla.devices.tpu import TpuDevice, one_chip_env
from tests.conftest import REPO, VENV_BIN, clean_env
from tests.devices.test_tpu import fake_metadata
from tests.multiproc import free_port, last_error, run_command, run_python


def _config(**settings) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, **settings}


def _run(cmd, cwd, **env) -> subprocess.CompletedProcess:
    return run_command(cmd, 300, cwd=cwd, env=clean_env(**env))


def _launch_host(tmp_path, hosts=None, **env) -> subprocess.CompletedProcess:
    """``deepspeed.launcher.launch`` as the runner starts it on every host (here: the first one)."""
    (tmp_path / "train.py").write_text("print('worker ran')\n")
    world = base64.urlsafe_b64encode(json.dumps(hosts or {"localhost": [0]}).encode()).decode()
    return _run([sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}", "--node_rank=0",
                 "--master_addr=127.0.0.1", f"--master_port={free_port()}", "train.py"], tmp_path, **env)


def _assert_no_worker(proc: subprocess.CompletedProcess) -> None:
    assert "spawned" not in proc.stdout + proc.stderr and "worker ran" not in proc.stdout


@pytest.mark.parametrize("setting", [{"fp16": {"enabled": True}},
                                     {"torch_autocast": {"enabled": True, "dtype": "torch.float16"}}],
                         ids=["fp16", "autocast-fp16"])
@pytest.mark.parametrize("device", ["TPU", "CPU"])
def test_fp16_names_bf16(monkeypatch, device, setting):
    monkeypatch.setenv("PJRT_DEVICE", device)  # only the device type's dtype support is asked: no runtime starts
    with pytest.raises(ValueError, match=rf"float16 training on PJRT {device}: .*bfloat16"):
        DeepSpeedConfig(_config(**setting))
    DeepSpeedConfig(_config(bf16={"enabled": True}))


# DeepSpeed's CPU Adam handed the XLA parameters themselves (the optimizer built by the script, no offload configured).
CPU_ADAM_ON_XLA = """
import json, sys, torch, deepspeed
from deepspeed.ops.adam import DeepSpeedCPUAdam

model = torch.nn.Linear(8, 2)
config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0}}
engine, *_ = deepspeed.initialize(model=model, optimizer=DeepSpeedCPUAdam(model.parameters(), lr=0.01), config=config)
try:
    engine.backward(engine(torch.randn(4, 8).to(engine.device)).pow(2).mean())
    engine.step()
    error = None
except AssertionError as exc:
    error = str(exc)
with open(sys.argv[1], "w") as handle:
    json.dump({"error": error}, handle)
"""


def test_nvme_offload_names_cpu():
    nvme = {"device": "nvme", "nvme_path": "/tmp"}
    with pytest.raises(ValueError, match=r'offload_param to "nvme" needs .*async_io.* set "device": "cpu"'):
        DeepSpeedConfig(_config(zero_optimization={"stage": 3, "offload_param": nvme}))
    DeepSpeedConfig(_config(zero_optimization={"stage": 2, "offload_optimizer": nvme}))  # ZeRO-1/2: same as cpu


def test_cuda_only_optimizer_names_the_alternatives():
    lion = {"type": "Lion", "params": {"lr": 0.01}}
    with pytest.raises(ValueError, match=r'"lion" runs DeepSpeed\'s FusedLionBuilder op .* no XLA implementation: '
                                         r'use "AdamW".*"offload_optimizer": \{"device": "cpu"\}'):
        DeepSpeedConfig(_config(optimizer=lion))
    DeepSpeedConfig(_config(optimizer=lion, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}))


def test_cpu_only_optimizer_on_xla_params_names_offload(tmp_path):
    out = tmp_path / "result.json"
    proc = _run([sys.executable, "-c", CPU_ADAM_ON_XLA, str(out)], tmp_path, DS_ACCELERATOR="xla")
    assert proc.returncode == 0, proc.stderr[-6000:]
    error = json.loads(out.read_text())["error"]
    assert "CPUAdam param is on xla:0 and must be 'cpu'" in error and "'offload_optimizer': 'cpu'" in error


TOO_MANY = ("3 processes were requested on this host but it has 2 CPU device(s): launch with deepspeed --num_gpus 2 "
            "or fewer (in a hostfile: slots=2 or fewer for this host), ")


def _assert_too_many_processes(proc: subprocess.CompletedProcess) -> str:
    """The launcher's error for 3 processes on 2 devices, before any worker started; returns it."""
    error = last_error(proc)
    assert TOO_MANY in error and "CPU_NUM_DEVICES" in error.split(TOO_MANY)[1]
    _assert_no_worker(proc)
    return error


def test_num_gpus_above_device_count_stops_the_launcher(tmp_path):
    """Also a worker that MPI, Slurm or torchrun started directly: the same error at its first device use."""
    (tmp_path / "train.py").write_text("print('worker ran')\n")
    error = _assert_too_many_processes(_run([str(VENV_BIN / "deepspeed"), "--num_gpus", "3", "--master_port",
                                             str(free_port()), "train.py"], tmp_path, DS_ACCELERATOR="xla",
                                            CPU_NUM_DEVICES=2, HOME=tmp_path))
    worker = run_python("import deepspeed\nfrom deepspeed.accelerator import get_accelerator\n"
                        "get_accelerator().set_device(0)\n", DS_ACCELERATOR="xla", LOCAL_RANK=0, LOCAL_SIZE=3,
                        CPU_NUM_DEVICES=2)
    assert error[error.index(TOO_MANY):] in last_error(worker)


def test_tpu_without_chips_stops_the_runner_naming_the_fix(tmp_path):
    """``PJRT_DEVICE=TPU`` on a host without TPU chips (this one, and every CI machine): the ``deepspeed`` runner says
    what is missing instead of DeepSpeed's "Unable to proceed, no GPU resources available"."""
    (tmp_path / "train.py").write_text("print('worker ran')\n")
    proc = _run([str(VENV_BIN / "deepspeed"), "--num_gpus", "1", "--master_port", str(free_port()), "train.py"],
                tmp_path, DS_ACCELERATOR="xla", PJRT_DEVICE="TPU", HOME=tmp_path)
    error = last_error(proc)
    assert "worker ran" not in proc.stdout and "no GPU resources" not in proc.stderr, proc.stderr[-3000:]
    assert error.startswith("RuntimeError: deepspeed_xla: PJRT_DEVICE=TPU but this host has no TPU chips"), error
    assert "set PJRT_DEVICE=CPU" in error, error


def test_master_port_in_use_stops_the_job_naming_the_port(tmp_path):
    """Another program listens on the master port: rank 0 cannot start the rendezvous store, and the job ends at once
    (upstream's error, which names the port) instead of waiting for the store."""
    (tmp_path / "train.py").write_text("import deepspeed\ndeepspeed.init_distributed()\nprint('worker ran')\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = _run([str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port",
                     str(port), "train.py"], tmp_path, DS_ACCELERATOR="xla", HOME=tmp_path)
        took = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "worker ran" not in output, output[-4000:]
    assert f"port: {port}" in output and "address already in use" in output, output[-4000:]
    assert took < 120, f"the job took {took:.0f} s to stop"


def test_hostfile_slots_above_device_count_stop_that_hosts_launcher(tmp_path):
    """A hostfile with ``slots=3`` per host: the runner sends each host's launcher its 3 ids (pdsh, or --no_ssh)."""
    hosts = {"worker-0": [0, 1, 2], "worker-1": [0, 1, 2]}
    _assert_too_many_processes(_launch_host(tmp_path, hosts, DS_ACCELERATOR="xla", CPU_NUM_DEVICES=2))


def test_tpu_host_runs_one_process_per_chip():
    tpu = TpuDevice()
    assert tpu.process_count_problem(4, 4) is None and tpu.process_count_problem(1, 4) is None
    error = tpu.process_count_problem(2, 4)
    assert "2 processes were requested on this host but it has 4 TPU chips" in error
    assert "deepspeed --num_gpus 4 (in a hostfile: slots=4 for every host)" in error


def test_single_tpu_process_takes_one_chip_like_torch_xla(monkeypatch):
    from torch_xla._internal import tpu
    keys = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS")
    fake_metadata(monkeypatch, "v6e-8")
    tpu.configure_one_chip_topology()  # what xmp.spawn(nprocs=1) sets
    expected = {key: os.environ[key] for key in keys}
    fake_metadata(monkeypatch, "v6e-8")
    env = dict(os.environ)
    TpuDevice().configure_process(0, 1, 0, env)
    assert {key: env[key] for key in keys} == expected
    with pytest.raises(RuntimeError, match="multi-host slice runs one process per chip on every host"):
        one_chip_env(0, tpu_version=4, hosts=4)


def _worker_import_error(monkeypatch, versions: dict) -> str:
    """The ImportError a worker gets from deepspeed_xla's torch_xla import with these installed versions (None:
    not installed), as a worker started without ``launch.py`` would."""

    def version(name):
        if versions.get(name, "2.9.0") is None:
            raise xla_runtime.metadata.PackageNotFoundError(name)
        return versions.get(name, "2.9.0")

    monkeypatch.setattr(xla_runtime.metadata, "version", version)
    with pytest.raises(ImportError) as raised:
        xla_runtime.torch_xla.__wrapped__()
    return str(raised.value)


def test_missing_torch_xla_stops_the_launcher(tmp_path, monkeypatch):
    """The launcher stops before starting workers; a worker started without it raises the same text."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\nfrom importlib import metadata\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch_xla':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "_discover = metadata.Distribution.discover\n"
        "metadata.Distribution.discover = classmethod(lambda cls, **kw: iter(()) "
        "if kw.get('name', '').replace('-', '_') == 'torch_xla' else _discover(**kw))\n")
    proc = _launch_host(tmp_path, DS_ACCELERATOR="xla", PYTHONPATH=shim)
    error = last_error(proc)
    assert "DS_ACCELERATOR=xla needs torch_xla installed: pip install torch==2.9.0 torch_xla==2.9.0" in error
    _assert_no_worker(proc)
    assert error.endswith(_worker_import_error(monkeypatch, {"torch_xla": None}))


def test_mismatched_torch_xla_stops_the_launcher(tmp_path, monkeypatch):
    """The launcher stops before starting workers; a worker started without it raises the same text."""
    fake = tmp_path / "fake" / "torch_xla-2.8.0.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_xla\nVersion: 2.8.0\n")
    proc = _launch_host(tmp_path, DS_ACCELERATOR="xla", PYTHONPATH=fake.parent)
    error = last_error(proc)
    assert "and torch_xla 2.8.0 are not a matching pair" in error
    assert "pip install torch==2.8.0 or torch_xla==2.9.0" in error
    _assert_no_worker(proc)
    torch_version = re.search(r"torch (\S+) and torch_xla 2\.8\.0", error)[1]  # the installed torch
    assert error.endswith(_worker_import_error(monkeypatch, {"torch": torch_version, "torch_xla": "2.8.0"}))


def test_train_batch_size_mismatch_names_the_product(monkeypatch):
    monkeypatch.setenv("LOCAL_SIZE", "1")  # as under a launcher
    monkeypatch.setenv("LOCAL_RANK", "0")
    config = _config(train_batch_size=7, gradient_accumulation_steps=1)
    world = DeepSpeedConfig(_config()).world_size
    with pytest.raises(ValueError, match=rf"^train_batch_size 7 is not train_micro_batch_size_per_gpu 2 x "
                                         rf"gradient_accumulation_steps 1 x {world} data-parallel process\(es\): "
                                         rf"set train_batch_size to {2 * world} \(or leave it out"):
        DeepSpeedConfig(config)


PLAIN_PYTHON = ("import torch, deepspeed\n"
                "deepspeed.initialize(model=torch.nn.Linear(2, 2), config={'train_batch_size': 8, "
                "'train_micro_batch_size_per_gpu': 4, 'gradient_accumulation_steps': 1, "
                "'optimizer': {'type': 'AdamW', 'params': {'lr': 0.1}}})\n")


@pytest.mark.parametrize("env, expected", [
    ({}, "x 1 data-parallel process(es): set train_batch_size to 4 (or leave it out and DeepSpeed derives it), or "
         "run 2 data-parallel processes (e.g. deepspeed --num_gpus 2). This process was started with plain python"),
    ({"WORLD_SIZE": 2}, "This process has WORLD_SIZE=2 but no RANK, MASTER_ADDR, MASTER_PORT, LOCAL_RANK: it was "
                        "started without a launcher. Start the script with the deepspeed launcher"),
], ids=["config-for-2-processes", "WORLD_SIZE-exported"])
def test_plain_python_with_world_size_above_one(tmp_path, env, expected):
    proc = _run([sys.executable, "-c", PLAIN_PYTHON], tmp_path, DS_ACCELERATOR="xla", **env)
    assert expected in last_error(proc)


def test_every_row_of_the_table_names_a_test_that_exists():
    rows = [line for line in (REPO / "docs" / "bad_input.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| misconfiguration")]
    assert len(rows) >= 12
    for row in rows:
        named = re.findall(r"`(?:([\w/]+\.py)::)?(test_\w+)`", row.rstrip(" |").rsplit("|", 1)[1])
        assert named, f"no test in: {row[:80]}"
        for file, name in named:
            source = (REPO / "tests" / file if file else Path(__file__)).read_text()
            assert f"def {name}(" in source, f"{file or Path(__file__).name} has no {name}"


@pytest.mark.parametrize("quantized", [("zero_quantized_weights", ), ("zero_quantized_nontrainable_weights", ),
                                       ("zero_quantized_gradients", "zero_quantized_weights")])
def test_zeropp_quantization_names_hpz(quantized):
    """ZeRO++'s quantized collectives run CUDA kernels; its hierarchical partitioning alone is accepted (and trains:
    ``test_parallelism.py``)."""
    zero = {"stage": 3, **{name: True for name in quantized}}
    names = ", ".join(name for name in ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
                                        "zero_quantized_gradients") if name in quantized)
    with pytest.raises(ValueError, match=rf"ZeRO\+\+ quantization \({names}\) needs DeepSpeed's QuantizerBuilder op .* "
                                         rf"no XLA implementation: set {names} to false"):
        DeepSpeedConfig(_config(zero_optimization=zero))
    DeepSpeedConfig(_config(zero_optimization={"stage": 3, "zero_hpz_partition_size": 2}))


@pytest.mark.parametrize("setting, expected", [
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 0.01}}},
     r'"OneBitAdam" is a 1-bit optimizer, which DeepSpeed 0.19.8 no longer has .*: use "Adam" or "AdamW"'),
    ({"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 0.01}}}, r'"ZeroOneAdam" is a 1-bit .*: use "Adam" or'),
    ({"optimizer": {"type": "OneBitLamb", "params": {"lr": 0.01}}}, r'"OneBitLamb" is a 1-bit .*: use "Lamb"'),
    ({"compile": {"deepcompile": True}}, r'"deepcompile": true.* inductor or eager .*: remove "deepcompile" .*'
                                         r'engine.compile\(\) for torch.compile with the openxla backend'),
    ({"autotuning": {"enabled": True}}, r'"autotuning".* compiles new graphs in the very steps it times: remove '
                                        r'"autotuning" and choose train_micro_batch_size_per_gpu'),
], ids=["OneBitAdam", "ZeroOneAdam", "OneBitLamb", "deepcompile", "autotuning"])
def test_features_without_an_xla_path_name_the_alternative(setting, expected):
    """Refused while DeepSpeed parses the config: upstream's own errors come later (DeepCompile's at
    ``engine.compile()``, an assertion naming no alternative for 1-bit optimizers), or never (the autotuner's
    experiments time compilations)."""
    with pytest.raises(ValueError, match=expected):
        DeepSpeedConfig(_config(**setting))
    DeepSpeedConfig(_config(compile={"deepcompile": False}, autotuning={"enabled": False}))
