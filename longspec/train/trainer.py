"""The training loop: build (target, drafter, data, DeepSpeed engine: build.py), then `Trainer.train()`.

`train_step` reads top to bottom: fetch this rank's micro-batches -> all-reduce the number of valid tokens ->
forward/backward per micro-batch (loss sum x world / global count, so gradients are the mean over ALL valid tokens
of the step, whatever their split across ranks and micro-batches) -> DeepSpeed clips and steps at the boundary ->
log -> periodic atomic checkpoint. Randomness that shapes a step (anchor offsets, the noisy lag) is drawn from
generators seeded by (seed, step, micro-step[, rank]), and the data position is the step itself, so a resumed run
repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from longspec.cli import USER_ERRORS, os_error_line
from longspec.data.loader import IGNORE_INDEX, StepSampler
from longspec.data.shards import ShardReader
from longspec.drafter.weights import nonfinite_counts
from longspec.lifetime import RunLock, exit_if_orphaned
from longspec.ownership import claim_output_dir
from longspec.positions import anchor_offset_position_ids
from longspec.train.build import build_engine, build_model, load_target_tokenizer
from longspec.train.checkpoint import RUN_KIND, CheckpointManager, latest_checkpoint, verify_checkpoint
from longspec.train.config import TrainConfig
from longspec.train.deepspeed_config import build_deepspeed_config, resolve_precision
from longspec.train.distributed import DistInfo, init_distributed
from longspec.train.inputs import run_inputs
from longspec.train.metrics import (
    METRICS_NAME,
    JsonlSink,
    MetricsLogger,
    WandbSink,
    setup_logging,
    truncate_metrics,
)
from longspec.train.preflight import check_data, check_data_ids, check_inputs, check_resume

__all__ = ["Trainer", "TrainingStopped"]

log = logging.getLogger("longspec.train")


class TrainingStopped(ValueError):
    """A run that cannot go on without training on numbers that are not numbers (one line, exit status 2)."""


class Trainer:
    def __init__(self, cfg: TrainConfig, dist_info: DistInfo | None = None):
        self.cfg = cfg
        self.dist = dist_info or init_distributed(cfg.deepspeed.backend)
        self.rank, self.world_size, self.device = self.dist.rank, self.dist.world_size, self.dist.device
        self.run_dir = os.path.abspath(cfg.output_dir)
        self.lock: RunLock | None = None
        self.nonfinite_steps = 0  # consecutive steps with a NaN / inf loss or gradient norm
        # Everything that can be a user error is checked here, before any model is loaded, by rank 0 (one reader
        # of the file system, one message), and every rank raises the same one-line error.
        self._agree(self._check_and_lock)
        try:
            self.resume_from, self.inputs, forced = self._agree(self._check_resume)
            self._build(forced)
        except BaseException:
            self._release_lock()
            raise

    def _check_resume(self) -> tuple[str | None, dict[str, Any], list[str]]:
        """Rank 0, under the lock: the run's inputs (`inputs.run_inputs`, saved in every checkpoint), and the
        checkpoint to resume from, its checksums verified before any of its files is parsed (DeepSpeed's ds/*.pt
        are pickles) and its inputs compared with this run's -> (checkpoint or None, inputs, forced changes)."""
        cfg = self.cfg
        inputs = run_inputs(cfg)
        resume_from = latest_checkpoint(self.run_dir) if cfg.checkpoint.resume == "auto" else None
        if resume_from is None:
            return None, inputs, []
        verify_checkpoint(resume_from)
        return resume_from, inputs, check_resume(resume_from, cfg, self.world_size, inputs)

    def _build(self, forced: list[str]) -> None:
        cfg = self.cfg
        setup_logging(self.run_dir, self.rank)
        if forced:
            log.warning("resume.force=true: resuming %s although %s", self.resume_from, "; ".join(forced))
        self.checkpoints = CheckpointManager(self.run_dir, keep_last=cfg.checkpoint.keep_last, rank=self.rank)
        self.checkpoints.remove_partial()
        self.zero3 = cfg.deepspeed.zero_stage == 3
        self.precision = resolve_precision(cfg.deepspeed.precision)
        self.dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32

        self.tokenizer = load_target_tokenizer(cfg.target)
        self.reader = ShardReader(cfg.data.path)
        check_data(self.reader.manifest, cfg, self.tokenizer)
        self.pad_id = self._pad_id()
        self.sampler = StepSampler(
            self.reader,
            global_batch_size=cfg.stage.global_batch_size,
            micro_batch_size=cfg.stage.micro_batch_size,
            world_size=self.world_size,
            seed=cfg.seed,
            shuffle=cfg.data.shuffle,
        )
        self.total_steps = (
            cfg.max_steps if cfg.max_steps > 0 else cfg.data.num_epochs * self.sampler.steps_per_epoch
        )
        self.ds_config = build_deepspeed_config(cfg, world_size=self.world_size)
        self.model = build_model(
            cfg,
            self.ds_config,
            dtype=self.dtype,
            device=self.device,
            rank=self.rank,
            tokenizer=self.tokenizer,
        )
        check_data_ids(self.reader.manifest, cfg, self.model.target.config.vocab_size)
        self.engine = build_engine(self.model, cfg, self.ds_config, self.total_steps)
        if self.zero3:
            self.model.replicate_head()

        self.step = 0
        self.tokens_seen = 0
        if self.resume_from is not None:
            self._resume(self.resume_from)
        self.metrics = self._build_metrics()
        target_params = list(self.model.target.parameters())
        full = sum(getattr(p, "ds_numel", p.numel()) for p in target_params)
        local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in target_params)
        log.info("frozen target: %d parameters, %d held by this rank", full, local)
        num_params = sum(
            p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.model.drafter.parameters()
        )
        log.info(
            "target %s (%s), drafter %.2fM params, data %s: %d rows; %d steps of %d sequences (grad accum %d x "
            "%d ranks), ZeRO-%d, %s",
            cfg.target.name,
            cfg.target.display,
            num_params / 1e6,
            cfg.data.path,
            len(self.reader),
            self.total_steps,
            cfg.stage.global_batch_size,
            self.sampler.grad_accum,
            self.world_size,
            cfg.deepspeed.zero_stage,
            self.precision,
        )
        # The frozen target's forward runs as the inference engine's does (packed q/k/v and gate/up, fused
        # element-wise steps): fewer kernels per layer, and the drafter learns from the K/V numbers it will read
        # at inference. After deepspeed.initialize, which casts the module (packing makes the HF weights views
        # of the packed ones); a sharded target (ZeRO-3) stays unpacked: pack_weights refuses it.
        if self.model.target.pack_weights():
            log.info("frozen target: packed projections and fused layer steps")

    # ---- run directory: checks, lock --------------------------------------------------------------------------
    def _agree(self, check):
        """Run `check()` on rank 0; every rank returns its result or raises its error as one ValueError."""
        outcome: list[Any] = [None, None]
        if self.rank == 0:
            try:
                outcome[0] = check()
            except (*USER_ERRORS, OSError) as e:  # a bad path, config, lock or checkpoint; a read-only folder
                if not isinstance(e, USER_ERRORS) and os_error_line(e) is None:
                    raise
                outcome[1] = os_error_line(e) or str(e)
        if self.world_size > 1:
            dist.broadcast_object_list(outcome, src=0)
        if outcome[1] is not None:
            raise ValueError(outcome[1])
        return outcome[0]

    def _check_and_lock(self) -> None:
        """Rank 0: inputs whole, then the run directory locked for this run (released in close())."""
        check_inputs(self.cfg)
        claim_output_dir(
            self.run_dir, RUN_KIND, what="output_dir"
        )  # a user's folder is refused, not written into
        lock = RunLock(self.run_dir)
        lock.acquire(force=self.cfg.resume.force)
        self.lock = lock

    def _release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ---- build ----------------------------------------------------------------------------------------------
    def _pad_id(self) -> int:
        tok = self.tokenizer
        if tok is not None:
            return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        pad = self.reader.manifest.tokenizer.get("pad_token_id")
        return pad if pad is not None else self.reader.manifest.tokenizer["eos_token_id"]

    def _build_metrics(self) -> MetricsLogger:
        if self.rank != 0:
            return MetricsLogger([], log_every=self.cfg.logging.log_every)
        truncate_metrics(self.run_dir, self.step)  # records past the resumed step are redone
        sinks = [JsonlSink(os.path.join(self.run_dir, METRICS_NAME))]
        if self.cfg.logging.wandb != "disabled":
            sinks.append(
                WandbSink(
                    mode=self.cfg.logging.wandb,
                    project=self.cfg.logging.wandb_project,
                    name=self.cfg.logging.run_name or os.path.basename(self.run_dir),
                    run_dir=self.run_dir,
                    config=asdict(self.cfg),
                )
            )
        return MetricsLogger(sinks, log_every=self.cfg.logging.log_every)

    # ---- per-step randomness --------------------------------------------------------------------------------
    def _seed(self, *key: int) -> int:
        return int(np.random.SeedSequence([self.cfg.seed, *key]).generate_state(1)[0])

    def _lag(self, step: int, micro: int) -> int:
        """Flash-noisy lag j ~ U{1..gamma-1}: one draw per micro-batch, the same on every rank."""
        if not self.cfg.stage.flash_noisy:
            return 0
        return int(
            np.random.default_rng(self._seed(step, micro, 1)).integers(1, self.cfg.stage.num_draft_levels)
        )

    def _position_ids(self, step: int, micro: int, batch_size: int, seq_len: int) -> torch.Tensor:
        stage = self.cfg.stage
        if stage.position_ids == "plain":
            return torch.arange(seq_len).expand(batch_size, seq_len)
        generator = torch.Generator().manual_seed(self._seed(step, micro, 2, self.rank))
        return anchor_offset_position_ids(
            batch_size,
            seq_len,
            max_len=stage.anchor_max_len,  # resolved by build_model
            num_anchors=stage.num_anchors,
            generator=generator,
        )

    # ---- the loop -----------------------------------------------------------------------------------------
    def train(self) -> None:
        last = self.total_steps if self.cfg.stop_at_step < 0 else min(self.cfg.stop_at_step, self.total_steps)
        if self.step >= last:
            log.info("nothing to do: step %d of %d already done", self.step, last)
        while self.step < last:
            exit_if_orphaned()  # a launcher of ours gone: stop (the parent-death signal's fallback)
            self.train_step()
            if self.step % self.cfg.checkpoint.save_every == 0 or self.step == last:
                self.save()

    def close(self) -> None:
        """Release the engine's hooks and buffers (several runs in one process: tests) and the run's lock."""
        try:
            self.metrics.close()
            self.engine.destroy()
        finally:
            self._release_lock()

    def train_step(self) -> dict[str, Any]:
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        step, cfg = self.step, self.cfg
        batches = self.sampler.micro_batches(
            step, self.rank, pad_id=self.pad_id, pad_to_multiple=cfg.data.pad_to_multiple
        )
        # Normalise by the valid tokens of the whole step on all ranks (one all-reduce, no host sync).
        local_valid = sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
        local_tokens = sum(b.num_tokens for b in batches)
        counts = torch.tensor([local_valid, local_tokens], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        # DeepSpeed averages gradients over ranks, hence x world size; accumulation scaling is ours (scale_wrt_gas).
        loss_scale = self.world_size / counts[0].clamp(min=1)
        count_correct = (step + 1) % cfg.logging.log_every == 0
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # ce, kl, correct
        for micro, batch in enumerate(batches):
            valid_rows = (batch.labels.view(-1) != IGNORE_INDEX).nonzero().squeeze(-1)
            position_ids = self._position_ids(step, micro, *batch.input_ids.shape)
            batch = batch.to(self.device)
            out = self.engine(
                batch.input_ids,
                position_ids.to(self.device),
                batch.labels,
                valid_rows.to(self.device),
                lag=self._lag(step, micro),
                count_correct=count_correct,
            )
            self.engine.backward(out.loss * loss_scale.to(out.loss.dtype), scale_wrt_gas=False)
            self.engine.step()  # DeepSpeed clips and updates only at the accumulation boundary
            sums += torch.stack([out.ce_sum.double(), out.kl_sum.double(), out.num_correct.double()])
        self.step += 1
        dist.all_reduce(sums)
        ce, kl, correct = sums.tolist()  # the step's one host sync (metrics.jsonl has every step)
        num_valid, num_tokens = counts.tolist()
        self.tokens_seen += int(num_tokens)
        elapsed = time.perf_counter() - start
        num_valid = max(num_valid, 1.0)
        grad_norm = self.engine.get_global_grad_norm()  # None where DeepSpeed has not computed one
        record = {
            "loss": (ce + cfg.loss.distill_weight * kl) / num_valid,
            "ce": ce / num_valid,
            "kl": kl / num_valid if cfg.loss.distill_weight > 0 else None,
            "acc": correct / num_valid if count_correct else None,
            "grad_norm": _as_float(grad_norm),
            "lr": self.engine.get_lr()[0],
            "tokens": int(num_tokens),
            "valid_tokens": int(num_valid),
            "tokens_seen": self.tokens_seen,
            "tokens_per_s": num_tokens / elapsed,
            "step_time_s": elapsed,
            "mem_gb": self._memory_gb(),
            "epoch": step // self.sampler.steps_per_epoch,
            "total_steps": self.total_steps,
        }
        if self.rank == 0:
            self.metrics.log(self.step, {k: v for k, v in record.items() if v is not None})
        # Checked here, where the loss and the norm are host numbers already (the step's one sync above; the norm
        # is read for the metrics line), so the check adds no sync of its own. Every rank sees the same reduced
        # loss and global norm, so every rank stops at the same step.
        finite = math.isfinite(record["loss"]) and (grad_norm is None or math.isfinite(record["grad_norm"]))
        self.nonfinite_steps = 0 if finite else self.nonfinite_steps + 1
        if self.nonfinite_steps >= cfg.max_nonfinite_steps:
            raise TrainingStopped(
                f"training stopped at step {self.step}: the loss or gradient norm was not finite for "
                f"{self.nonfinite_steps} consecutive steps (loss {record['loss']}, grad norm {record['grad_norm']}); "
                f"nothing of these steps was saved, the latest checkpoint is {self._latest_name()}: lower optim.lr "
                "or check the data, then resume (max_nonfinite_steps sets how many steps are tolerated)"
            )
        return record

    def _latest_name(self) -> str:
        latest = self.checkpoints.latest()
        return os.path.basename(latest) if latest else "none (the run restarts from step 0)"

    def _check_weights_finite(self) -> None:
        """Collective, before a checkpoint is written: refuse to save a drafter whose weights hold NaN / inf
        (one count per tensor of this rank's share, summed over the ranks: under ZeRO-3 each holds a shard)."""
        named = list(self.model.drafter.named_parameters())
        local = [p.ds_tensor if hasattr(p, "ds_tensor") else p for _, p in named]
        counts = nonfinite_counts(local).to(self.device)
        if self.zero3 and self.world_size > 1:
            dist.all_reduce(counts)
        # The one host sync of a save (not of a step).
        bad = [(name, n) for (name, _), n in zip(named, counts.tolist(), strict=True) if n]
        if bad:
            raise TrainingStopped(
                f"training stopped at step {self.step}: the drafter's weights hold NaN/inf values (tensor "
                f"{bad[0][0]!r}: {bad[0][1]}); not saved, the latest checkpoint is {self._latest_name()}: lower "
                "optim.lr or check the data, then resume"
            )

    def _memory_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        )  # KiB on Linux: the process's peak RSS

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def _save_drafter(self, out_dir: str) -> None:
        import deepspeed

        params = list(self.model.drafter.parameters())
        ctx = deepspeed.zero.GatheredParameters(params) if self.zero3 else nullcontext()
        with ctx:
            if self.rank == 0:
                self.model.drafter.save_pretrained(out_dir)

    def save(self) -> str:
        state = {
            "tokens_seen": self.tokens_seen,
            "total_steps": self.total_steps,
            "world_size": self.world_size,
            "stage": self.cfg.stage.name,
            "target": {
                "name": self.cfg.target.name,
                "path": self.cfg.target.path,
                "gguf_file": self.cfg.target.gguf_file,
            },
            "data": {
                "path": os.path.abspath(self.cfg.data.path),
                "rows": len(self.reader),
                "seq_len": self.reader.seq_len,
            },
            "init_from": self.cfg.init_from,
            "seed": self.cfg.seed,
            "inputs": self.inputs,  # what a resume compares (check_resume)
        }
        self._check_weights_finite()
        self.metrics.sync()  # the checkpoint's steps are in metrics.jsonl on disk before it is committed
        return self.checkpoints.save(self.step, self.engine, self._save_drafter, state)

    def _resume(self, path: str) -> None:
        # World size, target, data and stage were compared in __init__ (check_resume), before the model loaded.
        state = self.checkpoints.load(path, self.engine)
        if state["total_steps"] != self.total_steps:
            log.warning(
                "%s was trained towards %d steps, this run towards %d: the LR schedule changes from here on",
                path,
                state["total_steps"],
                self.total_steps,
            )
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        log.info("resumed from %s at step %d", path, self.step)


def _as_float(value) -> float:
    if value is None:
        return float("nan")
    return float(value.item() if torch.is_tensor(value) else value)
