"""The one place the DeepSpeed JSON is built, from the typed `DeepSpeedSettings` + the optimizer/batch fields."""

from __future__ import annotations

from typing import Any

import torch

from longspec.train.config import TrainConfig

__all__ = ["resolve_precision", "build_deepspeed_config"]


def resolve_precision(precision: str) -> str:
    """auto -> bf16 on CUDA, fp32 on CPU (CPU bf16 matmuls are slow and tests compare bitwise in fp32)."""
    if precision == "auto":
        return "bf16" if torch.cuda.is_available() else "fp32"
    return precision


def build_deepspeed_config(cfg: TrainConfig, *, world_size: int) -> dict[str, Any]:
    """DeepSpeed config dict for this run. The LR schedule is ours (passed to deepspeed.initialize), so
    there is no "scheduler" section; gradient accumulation follows from the batch sizes and world size."""
    ds, optim, stage = cfg.deepspeed, cfg.optim, cfg.stage
    per_step = stage.micro_batch_size * world_size
    if stage.global_batch_size % per_step:
        raise ValueError(
            f"stage.global_batch_size ({stage.global_batch_size}) must be a multiple of stage.micro_batch_size "
            f"({stage.micro_batch_size}) x the number of processes ({world_size})"
        )
    precision = resolve_precision(ds.precision)
    on_gpu = torch.cuda.is_available()
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage >= 1:
        zero.update(overlap_comm=on_gpu, contiguous_gradients=True, reduce_bucket_size=5e8)
    if ds.zero_stage == 3:
        zero.update(
            # Small frozen tensors (norms, biases) stay whole on every rank: gathering them costs more than it saves.
            stage3_param_persistence_threshold=1e5,
            stage3_prefetch_bucket_size=5e8,
            stage3_max_live_parameters=1e9,
            stage3_gather_16bit_weights_on_model_save=False,
        )
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    config: dict[str, Any] = {
        "train_batch_size": stage.global_batch_size,
        "train_micro_batch_size_per_gpu": stage.micro_batch_size,
        "gradient_accumulation_steps": stage.global_batch_size // per_step,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": optim.lr,
                "betas": list(optim.betas),
                "eps": optim.eps,
                "weight_decay": optim.weight_decay,
                # torch.optim.AdamW: no JIT-compiled op (FusedAdam compiles on first use and needs a CUDA toolchain).
                "torch_adam": not ds.offload_optimizer,
            },
        },
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": False},
        # Our logger prints one line per step; DeepSpeed's own would print every few steps on every rank.
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        # Gradients of the bf16 drafter are reduced and accumulated in fp32 (master weights are fp32 anyway).
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config
