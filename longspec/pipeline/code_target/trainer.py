"""The pretraining loop: AdamW, linear warmup then cosine decay, periodic held-out evaluation keeping the best
weights, and the atomic bf16 checkpoint save."""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from longspec.ownership import (
    MARKER_NAME,
    check_output_dir,
    remove_owned,
    resolve_output,
    swap_in,
    write_marker,
)
from longspec.pipeline.code_target.data import PackedStream
from longspec.pipeline.code_target.evaluate import autocast, evaluate, lm_loss_and_correct, resolve_device
from longspec.pipeline.code_target.presets import PretrainConfig, build_model_config, num_parameters

# The name the shipped checkpoint's train.log was written under.
log = logging.getLogger("pretrain_target")


def lr_at(progress: float, step: int, cfg: PretrainConfig) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from lr to lr*min_lr_ratio as progress goes 0 -> 1."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model, cfg: PretrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # RMSNorm gains
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def train(cfg: PretrainConfig, train_ids: np.ndarray, heldout_ids: np.ndarray, tokenizer) -> tuple:
    """Run the recipe; return ``(model with the best held-out weights, summary dict)``."""
    from transformers import LlamaForCausalLM

    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    config = build_model_config(cfg.preset, len(tokenizer), tokenizer, **cfg.model_overrides)
    n_params = num_parameters(config)
    if 2 * n_params / 1e6 > cfg.max_checkpoint_mb:
        raise ValueError(
            f"{n_params / 1e6:.2f}M parameters are {2 * n_params / 1e6:.1f} MB in bf16, over --max-checkpoint-mb "
            f"{cfg.max_checkpoint_mb}: pick a smaller preset or raise the limit"
        )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device)
    model.train()
    assert sum(p.numel() for p in model.parameters()) == n_params, (
        "num_parameters() out of sync with the model"
    )

    gen = torch.Generator().manual_seed(cfg.seed)
    train_t = torch.from_numpy(train_ids.astype(np.int64)).to(device)
    heldout_t = torch.from_numpy(heldout_ids.astype(np.int64)).to(device)
    stream = PackedStream(train_t, cfg.seq_len, cfg.batch_size, gen)
    steps_per_epoch = max(stream.windows_per_epoch // cfg.batch_size, 1)
    max_steps = int(cfg.max_epochs * steps_per_epoch)
    if cfg.max_steps is not None:
        max_steps = min(max_steps, cfg.max_steps)
    budget_s = None if cfg.max_minutes is None else 60.0 * cfg.max_minutes
    optimizer = make_optimizer(model, cfg, device)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    log.info(
        "model %s: %.2fM params (%.1f MB bf16); train %d tokens (%d steps/epoch of %d tokens), heldout %d tokens; "
        "max_steps %d, budget %s min, device %s",
        cfg.preset, n_params / 1e6, 2 * n_params / 1e6, train_ids.size, steps_per_epoch, tokens_per_step,
        heldout_ids.size, max_steps, cfg.max_minutes, device,
    )  # fmt: skip

    history, best, best_state, last_eval_step = [], None, None, None
    losses_since_log = []
    t0 = t_log = time.perf_counter()
    step = 0
    while step < max_steps:
        elapsed = time.perf_counter() - t0
        if budget_s is not None and elapsed >= budget_s:
            log.info("wall-clock budget reached at step %d", step)
            break
        progress = max(step / max_steps, 0.0 if budget_s is None else elapsed / budget_s)
        lr = lr_at(progress, step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        input_ids, labels = stream.next_batch()
        with autocast(device):
            loss_sum, _ = lm_loss_and_correct(model, input_ids, labels)
        loss = loss_sum / labels.numel()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses_since_log.append(loss.detach())
        step += 1

        if step % cfg.log_every == 0 or step == max_steps:
            mean_loss = float(torch.stack(losses_since_log).mean())  # host sync: log step
            now = time.perf_counter()
            mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
            log.info(
                "step %d/%d epoch %d loss %.4f grad-norm %.3f lr %.2e tok/s %.0f mem %.1fGiB",
                step, max_steps, stream.epoch, mean_loss, float(grad_norm), lr,
                len(losses_since_log) * tokens_per_step / (now - t_log), mem,
            )  # fmt: skip
            history.append({"step": step, "train_loss": mean_loss, "lr": lr})
            losses_since_log, t_log = [], now
        if step % cfg.eval_every == 0 or step == max_steps:
            ev = evaluate(model, heldout_t, cfg.seq_len, cfg.batch_size, cfg.eval_max_tokens)
            log.info(
                "eval step %d heldout loss %.4f ppl %.2f top1 %.4f", step, ev["loss"], ev["ppl"], ev["top1"]
            )
            history.append({"step": step, "heldout": ev})
            last_eval_step = step
            if best is None or ev["loss"] < best["loss"]:
                best = dict(ev, step=step)
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            t_log = time.perf_counter()  # evaluation time is not training throughput

    train_seconds = time.perf_counter() - t0
    if last_eval_step != step:  # stopped by the wall-clock budget between evaluations
        ev = evaluate(model, heldout_t, cfg.seq_len, cfg.batch_size, cfg.eval_max_tokens)
        if best is None or ev["loss"] < best["loss"]:
            best = dict(ev, step=step)
            best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    final = evaluate(model, heldout_t, cfg.seq_len, cfg.batch_size, None)
    log.info("best step %d: full heldout loss %.4f top1 %.4f", best["step"], final["loss"], final["top1"])
    summary = {
        "preset": cfg.preset,
        "num_parameters": n_params,
        "steps": step,
        "best_step": best["step"],
        "tokens_seen": step * tokens_per_step,
        "epochs_seen": step / steps_per_epoch,
        "train_seconds": round(train_seconds, 1),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "heldout": final,
        "history": history,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
    }
    return model, summary


CODE_TARGET_KIND = "code target"  # the ownership marker's kind of --out (longspec.ownership)


def save_checkpoint(model, tokenizer, out: Path, summary: dict) -> Path:
    """bf16 safetensors + config + tokenizer + metrics.json, written to a temp dir and renamed into place. `out`
    is replaced only if an earlier save wrote it (its ownership marker, nothing added since)."""
    out = Path(resolve_output(out))
    check_output_dir(out, CODE_TARGET_KIND, what="--out", whole=True)
    tmp = out.with_name(out.name + ".tmp")
    remove_owned(tmp, CODE_TARGET_KIND)  # a killed save's leftover (marked first thing below)
    tmp.mkdir()
    write_marker(tmp, CODE_TARGET_KIND)
    model = copy.deepcopy(model).to("cpu", torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_marker(tmp, CODE_TARGET_KIND, files=[p.name for p in tmp.iterdir() if p.name != MARKER_NAME])
    swap_in(str(tmp), str(out), CODE_TARGET_KIND)
    return out / "model.safetensors"
