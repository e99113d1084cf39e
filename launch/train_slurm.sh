#!/usr/bin/env bash
# sbatch --nodes 4 launch/train_slurm.sh stage=stage2_prolong target=qwq_32b data.path=/shared/data/stage2 output_dir=/shared/runs/qwq/stage2
# SLURM: one torchrun per node (srun), 8 GPUs each, c10d rendezvous on the first node. Re-submitting the same command
# resumes from the latest checkpoint in output_dir (checkpoint.resume=auto); stop_at_step=N ends a job early.
#SBATCH --job-name=longspec-train
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun \
    --nnodes "$SLURM_NNODES" --nproc_per_node "${GPUS_PER_NODE:-8}" \
    --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$HEAD_NODE:29500" \
    -m longspec.train "$@"
