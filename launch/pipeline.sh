#!/usr/bin/env bash
# bash launch/pipeline.sh TARGET NUM_GPUS [FIELD=VALUE ...]   e.g. bash launch/pipeline.sh llama31_8b 8
# The paper's three stages for one target (a configs/target/ YAML), each starting from the previous stage's exported
# drafter: stage 1 SlimPajama-6B (anchor-offset positions, 1K tokens, ZeRO-1) -> stage 2 long documents (32K,
# ZeRO-3) -> stage 3 long-context SFT (32K, ZeRO-3), on NUM_GPUS GPUs of this machine. It is
# `python -m longspec.pipeline --preset paper` (configs/pipeline/paper.yaml); FIELD=VALUE are Hydra
# overrides of that preset. Set STAGE2_SOURCES / STAGE3_SOURCE to your local or HF data; output in RUNS
# (default runs/TARGET). A finished step is skipped, so re-running the script continues an interrupted pipeline.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:?usage: launch/pipeline.sh TARGET NUM_GPUS}
NUM_GPUS=${2:?usage: launch/pipeline.sh TARGET NUM_GPUS}
shift 2
RUNS=${RUNS:-runs/$TARGET}
: "${STAGE2_SOURCES:?set STAGE2_SOURCES: ProLong-style long documents, e.g. 'code.jsonl books.jsonl tulu.jsonl'}"
: "${STAGE3_SOURCE:?set STAGE3_SOURCE: SFT rows with context, prompt and response (see data_prep.stage3_sft)}"
export PYTHONUNBUFFERED=1
# Quoted, so a path with a comma or space stays one list item of the Hydra override.
SOURCES=$(for s in $STAGE2_SOURCES; do printf "'%s'," "$s"; done)
python -m longspec.pipeline --preset paper --out "$RUNS" target_config="$TARGET" num_procs="$NUM_GPUS" \
    "stage2_sources=[${SOURCES%,}]" "stage3_source='$STAGE3_SOURCE'" "$@"
echo "drafter: $RUNS/runs/stage3/export"
