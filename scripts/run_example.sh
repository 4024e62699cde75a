#!/usr/bin/env bash
# The main job: train a small GPT with DeepSpeed ZeRO-2 on 2 XLA processes (PJRT CPU unless PJRT_DEVICE says TPU).
#   bash scripts/run_example.sh [extra train.py args]
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
set -euo pipefail
cd "$DSX_ROOT"
NUM_PROCS="${NUM_PROCS:-2}"
DS_ACCELERATOR=xla deepspeed --num_gpus "$NUM_PROCS" scripts/train.py \
  --deepspeed_config scripts/configs/zero2.json --steps "${STEPS:-20}" "$@"
