# bash launch/pretrain_target.sh [OUT_DIR] [extra longspec.pipeline.code_target flags, e.g. --preset gpu100m --max-minutes 8]
# Builds the stdlib corpus, trains the BPE tokenizer, tokenizes, pretrains the code target and evaluates it.
# Defaults reproduce the shipped longspec/assets/code_target (tiny preset; trained on one H200 in ~2 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/code_target}
shift || true
WORK=${WORK:-.cache_target}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

[ -f "$WORK/corpus/manifest.json" ] || python -m data_prep.stdlib_corpus --out "$WORK/corpus"
[ -f "$WORK/tokenizer/tokenizer.json" ] || \
    python -m data_prep.train_tokenizer --corpus "$WORK/corpus/train.jsonl" --vocab-size 8192 --out "$WORK/tokenizer"
python -m longspec.pipeline.code_target --corpus "$WORK/corpus" --tokenizer "$WORK/tokenizer" --tokens-dir "$WORK/tokens" \
    --out "$OUT" --preset tiny --max-minutes 3 --eval-every 100 "$@"
python -m longspec.pipeline.code_target --eval-only "$OUT" --tokens-dir "$WORK/tokens" --eval-seq-len 4096
