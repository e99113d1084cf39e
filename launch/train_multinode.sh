#!/usr/bin/env bash
# bash launch/train_multinode.sh HOSTFILE stage=stage2_prolong target=qwq_32b data.path=/shared/data/stage2 init_from=/shared/runs/qwq/stage1/export
# Several nodes with the `deepspeed` launcher (passwordless ssh between nodes, same paths everywhere, output_dir
# and data on a shared filesystem -- checkpoints are renamed into place by rank 0). HOSTFILE lists one node per line:
#   node-001 slots=8
#   node-002 slots=8
# The global batch stays stage.global_batch_size: gradient accumulation shrinks as nodes are added.
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTFILE=${1:?usage: launch/train_multinode.sh HOSTFILE [hydra overrides...]}
shift
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec deepspeed --hostfile "$HOSTFILE" --no_local_rank --module longspec.train "$@"
