#!/usr/bin/env bash
# GPU end to end (issue 5): pretrain a ~100M Llama code target on the stdlib corpus (launch/pretrain_target.py
# --preset gpu100m), train its LongSpec drafter through the three stages under DeepSpeed, and evaluate held-out code
# completion at 4K / 8K / 16K contexts: τ, tokens/s and speedup vs vanilla HF, vanilla FA and our AR decoding, T=0
# (+ CUDA-graph variants) and T=1. It is `python -m longspec.e2e --preset gpu` plus packing for a GPU box without
# network or stdlib corpus.
#
# 1. Here, once (CPU machine with the repo's venv; the GPU image has another Python, so the corpus is built here):
#        bash launch/gpu_e2e.sh --prepare                   # -> .cache_target/gpu_e2e/ (~13 MB, ignored by git)
# 2. On one H200, one device call of <= 10 minutes, carry [".dw", ".cache_target/gpu_e2e"]:
#        . .dw/install.sh && bash launch/gpu_e2e.sh [--set FIELD=VALUE ...]
#    (--set overrides a field of the gpu preset in longspec/e2e.py, e.g. --set stage1.num_steps=200).
# Output in $OUT (default outputs/gpu_e2e): report.md (tables), e2e_summary.json, e2e_logs.tar.gz (every step's
# log, the eval results.json files, plots, training metrics). The table is printed last. A failed stage does not
# stop the run: evaluation uses the latest drafter that exists, or the baselines alone (--keep-going).
# The pipeline is stopped (whole process group) after E2E_BUDGET_S seconds (default 520) so the report is written
# inside the device call's limit.
set -uo pipefail
cd "$(dirname "$0")/.."
# The device's copy of the tree has no current .git: the commit comes from .git_rev (longspec/provenance.py).
if [ -z "${LONGSPEC_COMMIT:-}" ] && [ -f .git_rev ]; then export LONGSPEC_COMMIT=$(cat .git_rev); fi
BUNDLE=${BUNDLE:-.cache_target/gpu_e2e}

if [ "${1:-}" = "--prepare" ]; then
    set -e
    SRC=${SRC:-.cache_target}  # launch/pretrain_target.sh's cache (corpus/, tokenizer/, tokens/), built if missing
    [ -f "$SRC/corpus/manifest.json" ] || python -m data_prep.stdlib_corpus --out "$SRC/corpus"
    if [ ! -f "$SRC/tokenizer/tokenizer.json" ]; then  # the shipped code target's tokenizer (same for both targets)
        mkdir -p "$SRC/tokenizer"
        cp longspec/assets/code_target/{tokenizer.json,tokenizer_config.json,chat_template.jinja} "$SRC/tokenizer/"
    fi
    [ -f "$SRC/tokens/meta.json" ] || python -m launch.pretrain_target --tokenize-only --corpus "$SRC/corpus" \
        --tokenizer "$SRC/tokenizer" --tokens-dir "$SRC/tokens"
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/corpus" "$BUNDLE/tokens"
    cp -r "$SRC/tokenizer" "$BUNDLE/tokenizer"
    cp "$SRC/corpus/"{manifest.json,heldout.jsonl,heldout_lcc.jsonl} "$BUNDLE/corpus/"
    gzip -c "$SRC/corpus/train.jsonl" > "$BUNDLE/corpus/train.jsonl.gz"
    cp "$SRC/tokens/"{meta.json,heldout.npy} "$BUNDLE/tokens/"
    gzip -c "$SRC/tokens/train.npy" > "$BUNDLE/tokens/train.npy.gz"
    du -sh "$BUNDLE"
    exit 0
fi

start=$(date +%s)
OUT=${OUT:-outputs/gpu_e2e}
WORK=${WORK:-/tmp/longspec_gpu_e2e}  # many files: only the summary and a log archive go to $OUT
DATA=$WORK/data_in
mkdir -p "$OUT" "$DATA/corpus" "$DATA/tokens"
[ -d "$BUNDLE/corpus" ] || { echo "no $BUNDLE: run 'bash launch/gpu_e2e.sh --prepare' first and carry it" >&2; exit 2; }
cp -r "$BUNDLE/tokenizer" "$DATA/"
cp "$BUNDLE/corpus/"*.json* "$DATA/corpus/" && gunzip -f "$DATA/corpus/train.jsonl.gz"
cp "$BUNDLE/tokens/"* "$DATA/tokens/" && gunzip -f "$DATA/tokens/train.npy.gz"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
python -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)"

# Own process group, so the watchdog stops torchrun and its workers too.
set -m
python -m longspec.e2e --preset gpu --out "$WORK/e2e" --data "$DATA" --keep-going "$@" > "$OUT/e2e.log" 2>&1 &
pipeline=$!
set +m
budget=${E2E_BUDGET_S:-520}
# The watchdog writes nothing to stdout (a reader of this script's output would wait for its sleep to end).
( sleep "$(( budget - ($(date +%s) - start) ))" && echo "gpu_e2e: budget of ${budget} s reached, stopping" \
    >> "$OUT/e2e.log" && kill -TERM -- -"$pipeline" ) > /dev/null 2>&1 &
watchdog=$!
wait "$pipeline"
kill "$watchdog" 2>/dev/null  # its sleep runs out on its own; it no longer stops anything

python -m longspec.e2e --preset gpu --out "$WORK/e2e" --data "$DATA" --report-only "$@" > "$OUT/e2e_table.txt" 2>&1
cp "$WORK/e2e/report.md" "$WORK/e2e/e2e_summary.json" "$OUT/" 2>/dev/null
tar -czf "$OUT/e2e_logs.tar.gz" -C "$WORK/e2e" --exclude='checkpoints' --exclude='*.safetensors' \
    --exclude='data' --exclude='target' logs runs eval_t0 eval_t0_graphs eval_t1_graphs e2e_manifest.json \
    target_summary.json training_loss.png 2>/dev/null
grep -E "done in|FAILED|skipped|fallback|budget" "$OUT/e2e.log"  # one line per step
cat "$OUT/e2e_table.txt"
echo "gpu_e2e: $(( $(date +%s) - start )) s"
