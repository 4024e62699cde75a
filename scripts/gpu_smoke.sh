#!/usr/bin/env bash
# GPU smoke test of PJRT_DEVICE=CUDA, for whoever has a host with NVIDIA GPUs (CI has none):
# scripts/train.py with DeepSpeed ZeRO-2 on 2 XLA:GPU processes for 20 steps, then the same run on DeepSpeed's
# own CPU accelerator, and the per-step losses compared.
#   bash scripts/gpu_smoke.sh                  NUM_PROCS, STEPS and TOLERANCE override 2, 20 and 2e-2
# The tolerance allows for TF32 matmuls on the GPU (XLA's default precision); it has not been tuned on hardware.
set -euo pipefail
NUM_PROCS="${NUM_PROCS:-2}"
STEPS="${STEPS:-20}"
TOLERANCE="${TOLERANCE:-2e-2}"

# Before the venv (minutes to build): a host without GPUs learns it at once.
listed="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)"
if [ "$listed" -eq 0 ]; then
  echo "gpu_smoke: no NVIDIA GPU found: 'nvidia-smi -L' lists none (no GPU, no driver, or nvidia-smi not on PATH)." \
       "Run this on a host with NVIDIA GPUs." >&2
  exit 1
elif [ "$listed" -lt "$NUM_PROCS" ]; then
  echo "gpu_smoke: needs $NUM_PROCS GPUs but 'nvidia-smi -L' lists $listed: run with NUM_PROCS=$listed." >&2
  exit 1
fi

source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
set -euo pipefail
cd "$DSX_ROOT"
# The [cuda] extra (the CUDA PJRT plugin and nvcc: deepspeed_xla/devices/cuda/wheels.py), which the CPU venv lacks.
env -u DS_ACCELERATOR pip install -q "$DSX_ROOT[cuda]"

# deepspeed_xla's own view: the GPUs this process may use (CUDA_VISIBLE_DEVICES included) and the plugin wheel.
PJRT_DEVICE=CUDA python - "$NUM_PROCS" <<'EOF'
import sys
from deepspeed_xla.devices.cuda import CudaDevice
device, wanted = CudaDevice(), int(sys.argv[1])
print(f"gpu_smoke: {device.describe()}")
problems = device.setup_problems()
if device.local_device_count() < wanted:
    problems.append(f"{wanted} processes need {wanted} visible GPUs; deepspeed_xla sees {device.local_device_count()}.")
for problem in problems:
    print(f"gpu_smoke: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
EOF

free_port() { python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
WORK="$(mktemp -d)"
export XLA_COORDINATOR_PORT="${XLA_COORDINATOR_PORT:-$(free_port)}"
train() {  # train <label> <env...>: one deepspeed run, losses to $WORK/<label>.json
  local label="$1"; shift
  echo "gpu_smoke: $label run ($NUM_PROCS processes, ZeRO-2, $STEPS steps)"
  env "$@" deepspeed --num_gpus "$NUM_PROCS" --master_port "$(free_port)" scripts/train.py \
    --deepspeed_config scripts/configs/zero2.json --steps "$STEPS" --losses-out "$WORK/$label.json"
}
# NVIDIA_TF32_OVERRIDE=0 keeps cuBLAS in full fp32 where XLA calls it (XLA's own GEMM kernels may still use TF32).
train xla-cuda DS_ACCELERATOR=xla PJRT_DEVICE=CUDA NVIDIA_TF32_OVERRIDE=0
train cpu DS_ACCELERATOR=cpu LOCAL_SIZE="$NUM_PROCS"

python - "$WORK/xla-cuda.json" "$WORK/cpu.json" "$TOLERANCE" <<'EOF'
import json, math, sys
gpu, cpu = (json.load(open(path)) for path in sys.argv[1:3])
tolerance = float(sys.argv[3])
assert gpu["world_size"] == cpu["world_size"], (gpu["world_size"], cpu["world_size"])
assert len(gpu["losses"]) == len(cpu["losses"]), (len(gpu["losses"]), len(cpu["losses"]))
for step, (a, b) in enumerate(zip(gpu["losses"], cpu["losses"])):
    print(f"step {step:3d}  xla-cuda {a:.6f}  cpu {b:.6f}  diff {abs(a - b):.2e}")
worst = max(abs(a - b) for a, b in zip(gpu["losses"], cpu["losses"]))
ok = all(math.isfinite(x) for x in gpu["losses"]) and worst <= tolerance
print(f"gpu_smoke: {'PASS' if ok else 'FAIL'}: largest loss difference {worst:.2e} (tolerance {tolerance:g}) over "
      f"{len(gpu['losses'])} steps on {gpu['world_size']} processes")
sys.exit(0 if ok else 1)
EOF
