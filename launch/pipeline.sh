#!/usr/bin/env bash
# bash launch/pipeline.sh TARGET NUM_GPUS   e.g. bash launch/pipeline.sh llama31_8b 8
# The paper's three stages for one target, each starting from the previous stage's exported drafter:
#   stage 1 SlimPajama-6B (anchor-offset positions, 1K tokens, ZeRO-1) -> stage 2 long documents (32K, ZeRO-3)
#   -> stage 3 long-context SFT (32K, ZeRO-3). Set STAGE2_SOURCES / STAGE3_SOURCE to your local or HF data.
# Every step is skipped when its output exists, so re-running the script continues an interrupted pipeline.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:?usage: launch/pipeline.sh TARGET NUM_GPUS}
NUM_GPUS=${2:?usage: launch/pipeline.sh TARGET NUM_GPUS}
MODEL=$(python -c "from longspec.train.config import load_config; print(load_config(['target=$TARGET', 'data.path=x']).target.path)")
DATA=${DATA:-data/$TARGET}
RUNS=${RUNS:-runs/$TARGET}
STAGE2_SOURCES=${STAGE2_SOURCES:?set STAGE2_SOURCES: ProLong-style long documents, e.g. "code.jsonl books.jsonl tulu.jsonl"}
STAGE3_SOURCE=${STAGE3_SOURCE:?set STAGE3_SOURCE: SFT rows {context, prompt, response} (see data_prep.stage3_sft)}

[ -f "$DATA/stage1/manifest.json" ] || python -m data_prep.stage1 --tokenizer "$MODEL" --out "$DATA/stage1"
[ -f "$RUNS/stage1/export/config.json" ] || {
    bash launch/train.sh "$NUM_GPUS" target="$TARGET" stage=stage1_slimpajama data.path="$DATA/stage1" output_dir="$RUNS/stage1"
    python -m longspec.export "$RUNS/stage1" "$RUNS/stage1/export" --overwrite
}

SOURCES=(); for s in $STAGE2_SOURCES; do SOURCES+=(--source "$s"); done
[ -f "$DATA/stage2/manifest.json" ] || python -m data_prep.stage2 --tokenizer "$MODEL" --out "$DATA/stage2" "${SOURCES[@]}"
[ -f "$RUNS/stage2/export/config.json" ] || {
    bash launch/train.sh "$NUM_GPUS" target="$TARGET" stage=stage2_prolong data.path="$DATA/stage2" \
        init_from="$RUNS/stage1/export" output_dir="$RUNS/stage2"
    python -m longspec.export "$RUNS/stage2" "$RUNS/stage2/export" --overwrite
}

[ -f "$DATA/stage3/manifest.json" ] || python -m data_prep.stage3_sft --tokenizer "$MODEL" --source "$STAGE3_SOURCE" --out "$DATA/stage3"
[ -f "$RUNS/stage3/export/config.json" ] || {
    bash launch/train.sh "$NUM_GPUS" target="$TARGET" stage=stage3_sft data.path="$DATA/stage3" \
        init_from="$RUNS/stage2/export" output_dir="$RUNS/stage3"
    python -m longspec.export "$RUNS/stage3" "$RUNS/stage3/export" --overwrite
}
echo "drafter: $RUNS/stage3/export"
