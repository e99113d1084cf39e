#!/usr/bin/env bash
# Every GPU check and benchmark in one run on a CUDA machine (one or two GPUs):
#     bash benchmarks/gpu_suite.sh                     (or STEPS="gpu_tests round_latency" bash ...)
# Each step has its own time limit; logs go to $OUT/steps.log; a failing step does not stop the next one.
set -u
OUT=${OUT:-outputs/gpu_suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# SETUP: a script sourced first, e.g. one that installs packages a GPU image lacks (deepspeed, hydra, liger, gguf).
if [ -n "${SETUP:-}" ]; then . "$SETUP"; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
git_rev=$(cat .git_rev 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
export LONGSPEC_COMMIT=${LONGSPEC_COMMIT:-$git_rev}  # what every benchmark stamps (longspec/provenance.py)
echo "commit $git_rev  $(date -u +%FT%TZ)  $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l)" | tee "$OUT/suite.log"

STEPS=${STEPS:-gpu_tests verify_attention row_argmax round_latency round_latency_smollm2 host_ops_smollm2 decode_methods_smollm2 profile_chain_t1 train_throughput train_zero3_2gpu}  # a subset: STEPS="..."

step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$(date +%s)
  echo "=================== $name: $*" >> "$OUT/steps.log"
  timeout "$limit" "$@" > "$OUT/step.tmp" 2>&1
  local rc=$?
  cat "$OUT/step.tmp" >> "$OUT/steps.log"
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$OUT/suite.log"
  tail -n 25 "$OUT/step.tmp"
  rm -f "$OUT/step.tmp"
}

step gpu_tests 100 python -m pytest -m gpu -o addopts="" -p no:cacheprovider -q tests
step verify_attention 60 python benchmarks/verify_attention.py --json "$OUT/verify_attention.json"
step row_argmax 60 env OUT="$OUT" python benchmarks/row_argmax.py
step round_latency 300 python benchmarks/round_latency.py --contexts 8192 32768 --json "$OUT/round_latency.json"
# SmolLM2-135M-Instruct: its real weights when SMOLLM2_GGUF names the file, else random weights of its shape.
smol=(--shape smollm2); [ -n "${SMOLLM2_GGUF:-}" ] && smol=(--target "$(dirname "$SMOLLM2_GGUF")" --gguf-file "$SMOLLM2_GGUF")
# every tree=auto candidate's whole round at T=0 and T=1 (the issue's round-cost goal) and the ring's catch-up
step round_latency_smollm2 200 python benchmarks/round_latency.py "${smol[@]}" --contexts 4096 8192 --round-costs \
  --no-hf-compile --json "$OUT/round_latency_smollm2.json"
step host_ops_smollm2 120 python benchmarks/host_ops.py --shape smollm2 --context 4096 --json "$OUT/host_ops.json"
step decode_methods_smollm2 200 python benchmarks/decode_methods.py --shape smollm2 --contexts 4096 8192 --tokens 64
# where a sampled chain-of-one round's device time goes, next to a plain step's (kernel by kernel)
step profile_chain_t1 150 env OUT="$OUT" python benchmarks/decode_methods.py --shape smollm2 --contexts 4096 \
  --methods ar_graphs longspec_graphs --tree 1 --tokens 128 --repeats 2 --profile --temperature 1
step train_throughput 130 python benchmarks/train_throughput.py --json "$OUT/train_throughput.json"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  step train_zero3_2gpu 100 torchrun --standalone --nproc_per_node 2 benchmarks/train_throughput.py \
    --zero-stage 3 --only stage2 --json "$OUT/train_zero3_2gpu.json"
fi
cat "$OUT/suite.log"
