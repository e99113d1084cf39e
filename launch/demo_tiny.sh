#!/usr/bin/env bash
# bash launch/demo_tiny.sh [OUT_DIR] [FIELD=VALUE ...]
# The whole pipeline on a CPU in a few minutes, 2 processes: the shipped code target, a standard-library corpus,
# stage 1 (ZeRO-1) -> export -> stage 2 (ZeRO-3, init_from) -> export -> stage 3 -> export -> evaluation. It is
# `python -m longspec.pipeline --preset demo_tiny` (configs/pipeline/demo_tiny.yaml); FIELD=VALUE are Hydra
# overrides of that preset (e.g. stage1.train.max_steps=5). Rerunning the same command continues where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/demo_tiny}
[ $# -gt 0 ] && shift
export WANDB_MODE=${WANDB_MODE:-disabled} PYTHONUNBUFFERED=1
python -m longspec.pipeline --preset demo_tiny --out "$OUT" "$@"
echo "drafter: $OUT/runs/stage3/export"
