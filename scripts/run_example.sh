#!/usr/bin/env bash
# The main job: train a small GPT with DeepSpeed ZeRO-2 on 2 XLA processes (PJRT CPU unless PJRT_DEVICE says TPU),
# printing step, loss and tokens/s, then drawing the loss curve into a PNG.
#   bash scripts/run_example.sh [extra train.py args, e.g. --deepspeed_config scripts/configs/zero3.json]
# Environment: NUM_PROCS (2), STEPS (20), MASTER_PORT (29500), LOSS_PLOT (loss_curve.png in the repository root).
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
set -euo pipefail
LOSS_PLOT="$(realpath -m "${LOSS_PLOT:-$DSX_ROOT/loss_curve.png}")"
cd "$DSX_ROOT"
NUM_PROCS="${NUM_PROCS:-2}"
DS_ACCELERATOR=xla deepspeed --num_gpus "$NUM_PROCS" --master_port "${MASTER_PORT:-29500}" scripts/train.py \
  --deepspeed_config scripts/configs/zero2.json --steps "${STEPS:-20}" --plot "$LOSS_PLOT" "$@"
echo "run_example.sh: done; the loss curve is in $LOSS_PLOT"
