# Source this file: creates (or reuses) the project's venv and installs deepspeed_xla into it.
#   source scripts/setup_env.sh   ->  $DSX_VENV/bin on PATH, PJRT_DEVICE defaulting to CPU
# The venv is keyed on requirements.txt's hash, so CI and developers reuse one 7.6 GB install (no CUDA PJRT plugin: the
# [cuda] extra, which scripts/gpu_smoke.sh installs).
set -euo pipefail
DSX_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DSX_HASH="$(cat "$DSX_ROOT/requirements.txt" | sha256sum | cut -c1-12)"
DSX_VENV="${DSX_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/deepspeed-xla/venv-$DSX_HASH}"
if [ ! -f "$DSX_VENV/.complete" ]; then
  echo "deepspeed_xla: creating $DSX_VENV (torch + torch_xla: a few minutes, 7.6 GB)" >&2
  rm -rf "$DSX_VENV"
  python3 -m venv "$DSX_VENV"
  "$DSX_VENV/bin/pip" install -q --upgrade pip setuptools wheel
  # DeepSpeed's sdist build reads DS_ACCELERATOR and fails on 'xla': install it without.
  env -u DS_ACCELERATOR "$DSX_VENV/bin/pip" install -q -r "$DSX_ROOT/requirements.txt"
  touch "$DSX_VENV/.complete"
fi
# This checkout goes into the venv unless the venv holds it already: the marker names the checkout and hashes the
# files its wheel is built from (after installing another copy into this venv by hand, delete the marker).
DSX_SOURCE="$DSX_ROOT $(cd "$DSX_ROOT" && find setup.py pyproject.toml deepspeed_xla -name '*.py' -o -name '*.toml' \
  | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16)"
if [ "$(cat "$DSX_VENV/.deepspeed-xla-source" 2>/dev/null)" != "$DSX_SOURCE" ]; then
  env -u DS_ACCELERATOR "$DSX_VENV/bin/pip" install -q --no-deps --force-reinstall "$DSX_ROOT"
  echo "$DSX_SOURCE" > "$DSX_VENV/.deepspeed-xla-source"
fi
export PATH="$DSX_VENV/bin:$PATH"
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
# DeepSpeed JIT-builds C++ ops (the CPU accelerator's shm all-reduce, cpu_adam) into this directory; one per venv, so
# another venv's build (other paths, other flags) never forces a 2-minute rebuild. XLA runs build none of them:
# scripts/run_tests.sh builds them for the tests' CPU-accelerator reference runs.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$DSX_VENV/torch_extensions}"
export DSX_VENV DSX_ROOT
set +euo pipefail
