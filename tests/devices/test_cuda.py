"""CUDA through JAX's PJRT plugin, on a machine without a GPU.

What runs for real: the plugin library found in the installed ``jax-cuda12-pjrt`` wheel, registered with
torch_xla, loaded by its runtime with the XLA coordinator between two processes, and failing with our
error at "No visible GPU devices". GPU hosts are faked through the driver's device list.

The CPU venv does not hold the ``[cuda]`` extra: ``scripts/run_tests.sh`` installs it (``wheels.requirements()``,
without dependencies) into a folder of the venv and names it in ``DSX_CUDA_EXTRA``; the tests that need the wheels
put it first on their path (``cuda_extra``).
"""
import json
import os
import subprocess
import types
from importlib import metadata
from pathlib import Path

import pytest
import torch

from deepspeed_xla.devices import cuda
from deepspeed_xla.devices.cuda import CudaDevice, cuda_process_settings, visible_gpu_count
from deepspeed_xla.devices.cuda import plugin, probe, wheels
from deepspeed_xla.launch_env import process_layout
from tests.conftest import FIXTURES, REPO, clean_env
from tests.multiproc import free_port, run_python, run_ranks

FAKE_GPU_DIR = "DSX_TEST_FAKE_GPU_DIR"


@pytest.fixture
def cuda_extra(monkeypatch) -> str:
    """The ``[cuda]`` extra's folder first on this process's path; returns the PYTHONPATH of the processes a test
    starts (with the session's py-cpuinfo answer, as ``clean_env`` gives it)."""
    folder = os.environ.get("DSX_CUDA_EXTRA")
    if not folder or not (Path(folder) / ".complete").is_file():
        pytest.fail("The [cuda] extra is not installed: run the tests through scripts/run_tests.sh (it installs "
                    "deepspeed_xla/devices/cuda/wheels.py's requirements() into $DSX_VENV/cuda-extra-<hash> and sets "
                    "DSX_CUDA_EXTRA).")
    monkeypatch.syspath_prepend(folder)
    return f"{folder}{os.pathsep}{FIXTURES / 'cpuinfo_cache'}"

# The reference: torch_xla's CUDA plugin, pytorch/xla plugins/cuda/torch_xla_cuda_plugin/__init__.py at
# 97b21f1183b19d184b5374dc86b83f2c6e0e56a3 (CudaPlugin.client_create_options / requires_xla_coordinator, the
# 2.7/2.8-dev version; the older 0236b0cf5341caa6e381b437b31a90423e80a1f0 computes the same for this layout),
# and the coordinator torch_xla's runtime starts for it (torch_xla/csrc/runtime/pjrt_registry.cc: task RANK of
# WORLD_SIZE at MASTER_ADDR:XLA_COORDINATOR_PORT, port 8547 by default). For 2 nodes x 4 GPUs under DeepSpeed's
# launcher it computes, per process: visible_devices=[LOCAL_RANK] (local world size > 1), node_id=RANK,
# num_nodes=WORLD_SIZE=8, platform "gpu", allocator "default", and a coordinator (WORLD_SIZE > 1).
TWO_NODES = [
    # (node, local rank, RANK, visible_devices, node_id)
    (0, 0, 0, [0], 0), (0, 1, 1, [1], 1), (0, 2, 2, [2], 2), (0, 3, 3, [3], 3),
    (1, 0, 4, [0], 4), (1, 1, 5, [1], 5), (1, 2, 6, [2], 6), (1, 3, 7, [3], 7),
]


@pytest.mark.parametrize("node, local_rank, rank, visible, node_id", TWO_NODES)
def test_two_nodes_match_the_reference_plugin(node, local_rank, rank, visible, node_id, cuda_extra):
    env = {"LOCAL_RANK": str(local_rank), "LOCAL_SIZE": "4", "CROSS_RANK": str(node), "RANK": str(rank),
           "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    layout = process_layout(env)
    device = CudaDevice()
    device.configure_process(layout.local_rank, layout.local_size, layout.node_rank, env)
    assert device.settings.client_options == {"platform_name": "gpu", "allocator": "default",
                                              "visible_devices": visible, "node_id": node_id, "num_nodes": 8}
    assert device.settings.requires_coordinator
    assert {key: env[key] for key in device.settings.env} == {
        "PJRT_LOCAL_PROCESS_RANK": str(local_rank), "PJRT_LOCAL_PROCESS_COUNT": "4", "RANK": str(rank),
        "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1", "XLA_COORDINATOR_PORT": "8547"}


KNOBS = [
    {},
    {"PJRT_ALLOCATOR_CUDA_ASYNC": "1"},
    {"PJRT_ALLOCATOR_CUDA_ASYNC": "0", "PJRT_ALLOCATOR_PREALLOCATE": "0"},
    {"PJRT_ALLOCATOR_FRACTION": "0.5", "PJRT_ALLOCATOR_PREALLOCATE": "1"},
    {"PJRT_ALLOCATOR_CUDA_ASYNC": "1", "PJRT_ALLOCATOR_FRACTION": ".9", "PJRT_ALLOCATOR_PREALLOCATE": "0"},
]


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "none")
def test_allocator_knobs_match_the_reference_plugin(monkeypatch, knobs):
    """The reference's allocator options, read with torch_xla's own parser (``xu.getenv_as``)."""
    import torch_xla.utils.utils as xu
    for name in ("PJRT_ALLOCATOR_CUDA_ASYNC", "PJRT_ALLOCATOR_FRACTION", "PJRT_ALLOCATOR_PREALLOCATE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in knobs.items():
        monkeypatch.setenv(name, value)
    reference = {
        "allocator": "cuda_async" if xu.getenv_as("PJRT_ALLOCATOR_CUDA_ASYNC", bool, False) else "default",
        "memory_fraction": xu.getenv_as("PJRT_ALLOCATOR_FRACTION", float, None),
        "preallocate": xu.getenv_as("PJRT_ALLOCATOR_PREALLOCATE", bool, None),
    }
    options = cuda_process_settings(1, 2, 1, 2, dict(os.environ)).client_options
    assert {key: options.get(key) for key in reference} == reference


def test_bad_allocator_knob_names_the_fix():
    with pytest.raises(ValueError, match=r"PJRT_ALLOCATOR_PREALLOCATE='yes' is not an integer: set it to 1"):
        cuda_process_settings(0, 1, 0, 1, {"PJRT_ALLOCATOR_PREALLOCATE": "yes"})


def test_single_process_has_no_coordinator_and_one_gpu():
    """Unlike the reference (all GPUs when the local world size is 1), a process always drives one GPU."""
    settings = cuda_process_settings(0, 1, 0, 1, {})
    assert settings.client_options["visible_devices"] == [0]
    assert (settings.client_options["node_id"], settings.client_options["num_nodes"]) == (0, 1)
    assert not settings.requires_coordinator


def test_global_rank_from_mpi_and_missing_rank_is_an_error():
    assert cuda.global_rank_and_size({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}, 2) == (3, 4)
    with pytest.raises(RuntimeError, match="needs each process's RANK and WORLD_SIZE"):
        cuda.global_rank_and_size({}, 2)
    with pytest.raises(RuntimeError, match="needs MASTER_ADDR"):
        cuda_process_settings(0, 2, 0, 4, {})


@pytest.mark.parametrize("host_gpus, visible, expected", [
    (4, None, 4), (4, "1,3", 2), (4, "", 0), (4, "-1", 0), (4, "0,7,1", 1), (4, "2,2,3", 1),
    (2, "0,1,2,3", 2), (4, "GPU-6f1a,GPU-77b2", 2), (0, "0", 0),
])
def test_cuda_visible_devices_rules(host_gpus, visible, expected):
    assert visible_gpu_count(host_gpus, visible) == expected


def _gpu_dir(root: Path, count: int) -> Path:
    """A fake ``/proc/driver/nvidia/gpus``: one folder per GPU, named by PCI address."""
    for index in range(count):
        (root / "gpus" / f"0000:00:{index + 4:02x}.0").mkdir(parents=True)
    (root / "gpus").mkdir(exist_ok=True)
    return root / "gpus"


def _run(code: str, *args: str, **env) -> subprocess.CompletedProcess:
    return run_python(code, *args, cwd=REPO, **env)


COUNT_CODE = """
import json, os, sys
from deepspeed_xla.devices.cuda import probe
import deepspeed
from deepspeed.accelerator import get_accelerator
counts = {}
probe.DRIVER_GPU_DIR = sys.argv[1]
counts["driver"] = get_accelerator().device_count()
os.environ["CUDA_VISIBLE_DEVICES"] = "1,3"
counts["narrowed"] = get_accelerator().device_count()
del os.environ["CUDA_VISIBLE_DEVICES"]
probe.DRIVER_GPU_DIR = sys.argv[2]
counts["nvidia_smi"] = get_accelerator().device_count()
counts["torch_xla_imported"] = "torch_xla" in sys.modules
print(json.dumps(counts))
"""


def test_device_count_on_a_fake_gpu_host_starts_no_runtime(tmp_path):
    nvidia_smi = tmp_path / "bin" / "nvidia-smi"
    nvidia_smi.parent.mkdir()
    nvidia_smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-6f1a)'\n"
                          "echo '  MIG 1g.5gb     Device  0: (UUID: MIG-0c2d)'\n"
                          "echo 'GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-77b2)'\n")
    nvidia_smi.chmod(0o755)
    proc = _run(COUNT_CODE, str(_gpu_dir(tmp_path, 4)), str(tmp_path / "absent"), DS_ACCELERATOR="xla",
                PJRT_DEVICE="CUDA", PATH=f"{nvidia_smi.parent}{os.pathsep}{clean_env()['PATH']}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"driver": 4, "narrowed": 2, "nvidia_smi": 2,
                                                        "torch_xla_imported": False}


def test_no_gpu_is_one_clear_error(tmp_path, cuda_extra):
    code = ("import sys\nfrom deepspeed_xla.devices.cuda import probe\nprobe.DRIVER_GPU_DIR = sys.argv[1]\n"
            "import deepspeed\nfrom deepspeed.accelerator import get_accelerator\nget_accelerator().set_device(0)\n")
    proc = _run(code, str(_gpu_dir(tmp_path, 0)), DS_ACCELERATOR="xla", PJRT_DEVICE="CUDA", CUDA_VISIBLE_DEVICES="0",
                PYTHONPATH=cuda_extra)
    assert proc.returncode == 1, proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == (
        "RuntimeError: PJRT_DEVICE=CUDA but no GPU is visible to this process: check that `nvidia-smi -L` lists the "
        "GPUs the driver sees and that CUDA_VISIBLE_DEVICES='0' names them, or set PJRT_DEVICE=CPU to run XLA on "
        "the host CPU.")


def setup_on_fake_gpus():
    """A worker of the two-process test: per-process setup on a host whose driver lists GPUs that CUDA cannot use."""
    probe.DRIVER_GPU_DIR = os.environ[FAKE_GPU_DIR]
    import deepspeed_xla
    deepspeed_xla.setup_process()


def test_plugin_from_the_wheel_starts_with_the_coordinator_and_fails_cleanly(tmp_path, cuda_extra):
    """torch_xla loads the wheel's library, starts the coordinator from our settings, connects both processes,
    and the client's "No visible GPU devices" becomes our error in each: no crash, no hang, no CPU fallback."""
    library = cuda.plugin_library()
    assert Path(library).is_relative_to(metadata.distribution(cuda.PLUGIN_DISTRIBUTION).locate_file(""))
    port = free_port()
    ranks = run_ranks("tests.devices.test_cuda:setup_on_fake_gpus", 2, timeout=280, env={
        "PJRT_DEVICE": "CUDA", FAKE_GPU_DIR: str(_gpu_dir(tmp_path, 2)), "XLA_COORDINATOR_PORT": port,
        "TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "pjrt_registry=3",
        "PYTHONPATH": cuda_extra})
    for rank, proc in enumerate(ranks):
        log = proc.stderr
        assert proc.returncode == 1, log[-3000:]
        assert f"Creating coordinator for rank={rank}, world size=2, coordinator address=127.0.0.1:{port}" in log
        assert f"GetPjrtApi was found for cuda at {library}" in log
        assert (
            f"RuntimeError: The CUDA PJRT plugin ({library}) could not start on visible GPU {rank}: No visible GPU "
            "devices. To fix: check that `nvidia-smi -L` lists the GPUs the driver sees, or set PJRT_DEVICE=CPU to "
            "run XLA on the host CPU.") in log.splitlines()
    assert "has connected to coordination service" in ranks[0].stderr


def test_report_rows_on_a_fake_gpu_host(monkeypatch, tmp_path, cuda_extra):
    """What ``ds_xla_report`` prints for CUDA (``describe``) and that a ready host has no setup problem."""
    monkeypatch.setattr(probe, "DRIVER_GPU_DIR", str(_gpu_dir(tmp_path, 4)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    device = CudaDevice()
    assert device.describe() == (
        f"2 GPU(s) visible (host: 4, from {probe.DRIVER_GPU_DIR}, narrowed by CUDA_VISIBLE_DEVICES=2,3); "
        f"CUDA PJRT plugin: jax-cuda12-pjrt {metadata.version('jax-cuda12-pjrt')} ({cuda.plugin_library()})")
    assert device.setup_problems() == []


def test_the_cpu_venv_holds_no_cuda_wheel_and_the_extra_has_both():
    """The main job installs nothing it does not use: the wheels are the installed package's ``cuda`` extra alone."""
    for name in (wheels.PLUGIN_DISTRIBUTION, wheels.TOOLKIT_DISTRIBUTION):
        with pytest.raises(metadata.PackageNotFoundError):
            metadata.distribution(name)
    extra = [req.split(";")[0].replace(" ", "") for req in metadata.requires("deepspeed-xla")
             if req.replace(" ", "").endswith('extra=="cuda"')]
    assert extra == wheels.requirements()


def test_missing_plugin_wheel_names_the_extra(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(cuda.metadata, "distribution", missing)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(probe, "driver_gpu_count", lambda: 1)
    assert CudaDevice().setup_problems() == [
        "PJRT_DEVICE=CUDA needs the CUDA PJRT plugin: pip install 'deepspeed-xla[cuda]' (or pip install "
        "jax-cuda12-pjrt==0.7.1 --no-deps)."]


def test_toolkit_is_looked_up_where_xla_looks(tmp_path, cuda_extra):
    """XLA searches ``../../nvidia/cuda_nvcc`` from the plugin library's folder (its CandidateCudaRoots)."""
    library = tmp_path / "jax_plugins" / "xla_cuda12" / plugin.PLUGIN_LIBRARY
    ptxas = tmp_path / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    for path in (library, ptxas):
        path.parent.mkdir(parents=True)
        path.touch()
    problem = cuda.toolkit_problem(str(library))
    assert problem.startswith(f"XLA needs CUDA's nvvm/libdevice/libdevice.10.bc in {ptxas.parents[1]} to compile")
    assert "pip install 'deepspeed-xla[cuda]'" in problem
    assert cuda.toolkit_problem(cuda.plugin_library()) is None  # the installed wheels are laid out as XLA expects


CAPABILITIES = [(6, 0), (6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (9, 0), (10, 0)]


@pytest.mark.parametrize("allow_deprecated_fp16", ["0", "1"])
@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_dtypes_as_the_gpu_supports_them(monkeypatch, capability, allow_deprecated_fp16):
    """bf16 as torch reports native support; fp16 as DeepSpeed's own CUDA accelerator decides, from the same
    compute capability."""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    monkeypatch.setenv("DS_ALLOW_DEPRECATED_FP16", allow_deprecated_fp16)
    monkeypatch.setattr(cuda, "compute_capability", lambda: capability)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(major=capability[0], minor=capability[1]))
    assert CudaDevice().is_bf16_supported() == torch.cuda.is_bf16_supported(including_emulation=False)
    assert CudaDevice().is_fp16_supported() == CUDA_Accelerator.is_fp16_supported(None)


def test_compute_capability_without_the_driver_library_names_the_fix(monkeypatch):
    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(probe.ctypes, "CDLL", no_library)
    cuda.compute_capability.cache_clear()
    with pytest.raises(RuntimeError, match=r"libnvidia-ml\.so\.1 .* NVIDIA_DRIVER_CAPABILITIES=compute,utility"):
        cuda.compute_capability()
