#!/usr/bin/env bash
# Installs everything (reusing the venv when present) and runs the test suite on PJRT CPU.
#   bash scripts/run_tests.sh [pytest args]
bash "$(dirname "${BASH_SOURCE[0]}")/install_launchers.sh"
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
set -euo pipefail
cd "$DSX_ROOT"
# DeepSpeed's CPU ops, built once into the venv's TORCH_EXTENSIONS_DIR (setup_env.sh) instead of inside the first
# tests that load them (~2 minutes with g++): the CPU accelerator's shm all-reduce and FusedAdam (every reference run
# of the tests) and cpu_adam (ZeRO-Offload's DeepSpeedCPUAdam). The marker names the directory they were built into.
DSX_OPS_MARKER="$DSX_VENV/.deepspeed-ops-built"
if [ "$(cat "$DSX_OPS_MARKER" 2>/dev/null)" != "$TORCH_EXTENSIONS_DIR" ]; then
  echo "deepspeed_xla: building DeepSpeed's CPU ops into $TORCH_EXTENSIONS_DIR (once, a few minutes)" >&2
  # A build stopped part-way (no marker yet) leaves its lock, and torch waits on a lock for ever: nothing else builds
  # into this venv's directory before the marker exists.
  rm -f "$TORCH_EXTENSIONS_DIR"/*/lock
  DS_ACCELERATOR=cpu python -c "
from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, FusedAdamBuilder, ShareMemCommBuilder
for builder in (ShareMemCommBuilder, FusedAdamBuilder, CPUAdamBuilder):
    builder().load(verbose=False)
"
  echo "$TORCH_EXTENSIONS_DIR" > "$DSX_OPS_MARKER"
fi
# beside_venv NAME REQUIREMENT...: installs the requirements without dependencies into a folder of the venv keyed on
# them (once) and prints it. Tests that need them put it first on PYTHONPATH; the venv itself does not hold them.
beside_venv() {
  local folder
  folder="$DSX_VENV/$1-$(echo "${*:2}" | sha256sum | cut -c1-12)"
  if [ ! -f "$folder/.complete" ]; then
    rm -rf "$folder"
    pip install -q --no-deps --target "$folder" "${@:2}" >&2 || return 1
    touch "$folder/.complete"
  fi
  echo "$folder"
}
# The oldest supported Hugging Face releases (deepspeed_xla/patches/registry.py, SUPPORTED), for the smoke runs of
# tests/launched/test_huggingface_oldest.py only. The venv itself holds the newest (requirements.txt).
HF_OLDEST_SET="$(python -c \
  "from deepspeed_xla.patches.registry import oldest_requirements; print(*oldest_requirements())")"
DSX_HF_OLDEST="$(beside_venv hf-oldest $HF_OLDEST_SET)"
# The [cuda] extra (deepspeed_xla/devices/cuda/wheels.py: the CUDA PJRT plugin and nvcc), for tests/devices/test_cuda.py
# only: the CPU venv (requirements.txt) does not hold it.
CUDA_EXTRA_SET="$(python -c "from deepspeed_xla.devices.cuda.wheels import requirements; print(*requirements())")"
DSX_CUDA_EXTRA="$(beside_venv cuda-extra $CUDA_EXTRA_SET)"
export DSX_HF_OLDEST DSX_CUDA_EXTRA
# The compile-only TPU toolchain (JAX and libtpu, requirements-compile.txt) in a venv of its own, built once beside the
# main one: tests/bench/test_tpu_compile.py compiles the traced step graphs with it (bench/tpu_compile.py).
DSX_COMPILE_PYTHON="$(bash "$DSX_ROOT/scripts/setup_compile_env.sh")"
export DSX_COMPILE_PYTHON
# Two workers (pytest-xdist): a launched run leaves a core idle while its launcher and workers import; each module's
# tests stay on one worker (tests/conftest.py's groups).
python -m pytest tests -q -p no:cacheprovider --timeout 900 --durations=15 -n 2 --dist loadgroup --no-loadscope-reorder "$@"
