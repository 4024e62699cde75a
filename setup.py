"""deepspeed-xla: DeepSpeed on XLA devices.

The ``deepspeed_xla.pth`` startup file is copied next to the package in site-packages, for both
``pip install .`` and ``pip install -e .``; it makes every interpreter honour ``DS_ACCELERATOR=xla``.
"""
import importlib.util
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "deepspeed_xla.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


def _standalone(*path: str):
    """A module of the package that imports only the standard library, loaded before its dependencies exist."""
    spec = importlib.util.spec_from_file_location("_dsx_" + path[-1][:-3], os.path.join(HERE, "deepspeed_xla", *path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_requirements():
    """The ``hf`` extra: the Hugging Face releases the patches are tested with, from the patch table
    (``deepspeed_xla/patches/registry.py``)."""
    registry = _standalone("patches", "registry.py")
    return [registry.requirement(name) for name in registry.SUPPORTED]


class BuildPyWithPth(build_py):
    """Put the startup file at the root of the wheel (= site-packages); editable wheels included."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


class EditableWheelWithPth(editable_wheel):
    """``pip install -e .``: editable wheels hold only a path finder, so add the startup file to the wheel root."""

    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        self.copy_file(os.path.join(HERE, PTH), os.path.join(unpacked_wheel, PTH), preserve_mode=0)
        return result


setup(
    name="deepspeed-xla",
    version="0.1.0",
    description="DeepSpeed on XLA devices (Cloud TPU; PJRT CPU for development)",
    long_description=open(os.path.join(HERE, "README.md")).read() if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["deepspeed_xla", "deepspeed_xla.*"]),
    # the GPU descriptions XLA's GPU compiler reads for --gpu-compile (bench/tpu_compile.py)
    package_data={"deepspeed_xla.bench": ["gpu_targets/*.txtpb"]},
    python_requires=">=3.10",
    install_requires=[
        "torch==2.9.0",
        "torch_xla==2.9.0",
        "deepspeed>=0.19.8,<0.19.9",
        "tpu-info>=0.14",
        "psutil",
    ],
    extras_require={
        "tpu": ["torch_xla[tpu]==2.9.0"],
        # NVIDIA GPUs: JAX's CUDA 12 PJRT plugin library (JAX itself is not needed) and the ptxas/libdevice XLA
        # compiles with (deepspeed_xla/devices/cuda/wheels.py); torch 2.9.0 brings the other CUDA 12.8 libraries.
        "cuda": _standalone("devices", "cuda", "wheels.py").requirements(),
        # DeepSpeed asks mpi4py for ranks where mpirun starts a script without the deepspeed runner.
        "mpi": ["mpi4py"],
        # The Trainer with --deepspeed, accelerate launch and PEFT (docs/huggingface.md): the lowest to the highest
        # release of each that deepspeed_xla's patches are tested with.
        "hf": hf_requirements(),
        "test": ["pytest", "pytest-timeout", "matplotlib"],
    },
    entry_points={"console_scripts": ["ds_xla_report=deepspeed_xla.report:main"]},
    cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth},
)
