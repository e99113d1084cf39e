#!/usr/bin/env bash
# bash launch/demo_tiny.sh [OUT_DIR]
# The whole training pipeline on a CPU in a few minutes: a tiny random Llama target + byte tokenizer, stage-1 data
# from the Python standard library, stage 1 (ZeRO-1) -> export -> stage 2 (ZeRO-3, init_from) -> export, 2 processes.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/demo_tiny}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} WANDB_MODE=${WANDB_MODE:-disabled} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
python -c "from longspec.testing import save_tiny_target; save_tiny_target('llama', '$OUT/target')"
python -m data_prep.stage1 --source "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/json" \
    --tokenizer "$OUT/target" --out "$OUT/data1" --seq-len 64 --overwrite
python -m data_prep.stage2 --source "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/email" \
    --tokenizer "$OUT/target" --out "$OUT/data2" --seq-len 128 --min-tokens 64 --overwrite
COMMON="target=tiny_llama target.path=$OUT/target"
bash launch/train.sh 2 $COMMON stage=tiny_stage1 data.path="$OUT/data1" output_dir="$OUT/stage1" max_steps=20
python -m longspec.export "$OUT/stage1" "$OUT/stage1/export" --overwrite
bash launch/train.sh 2 $COMMON stage=tiny_stage2 data.path="$OUT/data2" output_dir="$OUT/stage2" max_steps=10 \
    init_from="$OUT/stage1/export"
python -m longspec.export "$OUT/stage2" "$OUT/stage2/export" --overwrite
echo "drafter: $OUT/stage2/export"
