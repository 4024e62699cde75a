#!/usr/bin/env bash
# Creates (or reuses) the compile-only venv of requirements-compile.txt and prints its python: the TPU and GPU
# compilers that `python -m deepspeed_xla.bench --tpu-compile/--gpu-compile` runs in a subprocess
# (deepspeed_xla/bench/tpu_compile.py). Keyed on that file's hash, beside the main venv (~520 MB downloaded; a minute
# or two).
#   DSX_COMPILE_PYTHON="$(bash scripts/setup_compile_env.sh)"
set -euo pipefail
DSX_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DSX_COMPILE_HASH="$(sha256sum < "$DSX_ROOT/requirements-compile.txt" | cut -c1-12)"
DSX_COMPILE_VENV="${DSX_COMPILE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/deepspeed-xla/compile-$DSX_COMPILE_HASH}"
if [ ! -f "$DSX_COMPILE_VENV/.complete" ]; then
  echo "deepspeed_xla: creating $DSX_COMPILE_VENV (JAX, libtpu, JAX's CUDA plugin and ptxas; compile only: ~520 MB)" >&2
  rm -rf "$DSX_COMPILE_VENV"
  python3 -m venv "$DSX_COMPILE_VENV"
  "$DSX_COMPILE_VENV/bin/pip" install -q -r "$DSX_ROOT/requirements-compile.txt" >&2
  touch "$DSX_COMPILE_VENV/.complete"
fi
echo "$DSX_COMPILE_VENV/bin/python"
