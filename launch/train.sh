#!/usr/bin/env bash
# bash launch/train.sh NUM_GPUS target=llama31_8b stage=stage1_slimpajama data.path=data/stage1/llama31_8b [overrides...]
# One node, one process per GPU. Uses the `deepspeed` launcher when present, else torchrun; both work.
# CPU smoke run (2 processes, gloo): DS_ACCELERATOR=cpu bash launch/train.sh 2 stage=tiny_stage1 target=tiny_llama ...
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_PROCS=${1:?usage: launch/train.sh NUM_GPUS [hydra overrides...]}
shift
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if command -v deepspeed >/dev/null 2>&1; then
    exec deepspeed --num_gpus "$NUM_PROCS" --no_local_rank --module longspec.train "$@"
else
    exec torchrun --standalone --nproc_per_node "$NUM_PROCS" -m longspec.train "$@"
fi
