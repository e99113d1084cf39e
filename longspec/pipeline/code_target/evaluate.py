"""Held-out loss / top-1 accuracy, greedy continuations and their degeneracy statistic, for a model in training or
a saved checkpoint."""

# Shape legend: B sequences per step, T tokens per sequence (seq_len), V vocabulary.

from __future__ import annotations

import inspect
import itertools
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from longspec.pipeline.code_target.data import load_token_cache, load_tokenizer, tokenize_jsonl


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for but no CUDA device is visible")
    return torch.device(name)


def autocast(device: torch.device):
    # bf16 autocast on CUDA (fp32 master weights in AdamW); CPU trains in fp32, where bf16 matmuls are slower.
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def lm_loss_and_correct(
    model, input_ids: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy (fp32) and top-1 hit count over ``[B,T]``.

    Full ``[B,T,V]`` logits are fine here: V is 8192 (a 16x4096 batch is 1 GB in bf16). The drafter trainer uses the
    fused linear cross-entropy instead, because real targets have 150K-entry vocabularies.
    """
    logits = model(input_ids=input_ids).logits  # [B, T, V]
    flat = logits.flatten(0, 1).float()
    loss_sum = F.cross_entropy(flat, labels.flatten(), reduction="sum")
    correct = (flat.argmax(-1) == labels.flatten()).sum()
    return loss_sum, correct


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, seq_len: int, batch_size: int, max_tokens: int | None = None) -> dict:
    """Mean held-out loss / top-1 accuracy over consecutive non-overlapping windows from the stream's start."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    usable = (ids.numel() - 1) if max_tokens is None else min(ids.numel() - 1, max_tokens)
    num_windows = max(usable // seq_len, 1)
    seq = min(seq_len, ids.numel() - 1)
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    offsets = torch.arange(seq + 1, device=ids.device)
    for first in range(0, num_windows, batch_size):
        starts = seq * torch.arange(first, min(first + batch_size, num_windows), device=ids.device)
        window = ids[starts[:, None] + offsets].to(device)
        with autocast(device):
            batch_loss, batch_correct = lm_loss_and_correct(model, window[:, :-1], window[:, 1:])
        loss_sum += batch_loss
        correct += batch_correct
    model.train(was_training)
    tokens = num_windows * seq
    loss = float(loss_sum) / tokens  # host sync: evaluation result
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "top1": float(correct) / tokens, "tokens": tokens}


def degeneracy(token_ids: list[int]) -> dict:
    """Distinct-token ratio and the longest run of one repeated token (1.0 / 1 = no repetition at all)."""
    if not token_ids:
        return {"distinct_ratio": 0.0, "longest_run": 0}
    longest = run = 1
    for prev, cur in itertools.pairwise(token_ids):
        run = run + 1 if cur == prev else 1
        longest = max(longest, run)
    return {"distinct_ratio": len(set(token_ids)) / len(token_ids), "longest_run": longest}


@torch.no_grad()
def greedy_continue(model, prefix: torch.Tensor, num_new: int) -> list[int]:
    """Plain greedy decoding with an HF KV cache (no EOS stop: the degeneracy statistic needs a fixed length)."""
    from transformers import DynamicCache

    model.eval()
    device = next(model.parameters()).device
    # transformers renamed the forward's cache argument (past_key_values -> cache) within our supported range;
    # we own the cache object (updated in place), so only the keyword differs.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=prefix.to(device)[None], use_cache=True, **{cache_kw: cache}).logits
    new = []
    for _ in range(num_new):
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        new.append(int(nxt))  # host sync per token: fine for a handful of samples
        logits = model(input_ids=nxt, use_cache=True, **{cache_kw: cache}).logits
    return new


def greedy_samples(model, tokenizer, heldout: torch.Tensor, *, num: int = 3, prefix_tokens: int = 192,
                   new_tokens: int = 64) -> list[dict]:  # fmt: skip
    """Greedy continuations of the first held-out files long enough, with degeneracy and match-to-truth stats."""
    bos = tokenizer.bos_token_id
    starts = (heldout == bos).nonzero().flatten().tolist() + [heldout.numel()]
    samples = []
    for a, b in itertools.pairwise(starts):
        if len(samples) == num:
            break
        if b - a < prefix_tokens + new_tokens:
            continue
        doc = heldout[a:b].long()
        prefix, truth = doc[:prefix_tokens], doc[prefix_tokens : prefix_tokens + new_tokens].tolist()
        cont = greedy_continue(model, prefix, new_tokens)
        samples.append(
            {
                "prefix_tail": tokenizer.decode(prefix[-48:].tolist()),
                "continuation": tokenizer.decode(cont),
                "truth": tokenizer.decode(truth),
                "token_match": sum(c == t for c, t in zip(cont, truth, strict=True)) / new_tokens,
                **degeneracy(cont),
            }
        )
    return samples


def eval_checkpoint(ckpt: Path, *, tokens_dir: Path | None, corpus: Path | None, seq_len: int, batch_size: int,
                    device: str, num_samples: int, max_tokens: int | None) -> dict:  # fmt: skip
    """Held-out loss / top-1 and greedy samples of a saved checkpoint (fp32 on CPU, bf16 autocast on CUDA)."""
    from transformers import AutoModelForCausalLM

    if not (Path(ckpt) / "config.json").is_file():
        raise FileNotFoundError(f"{ckpt} is not a checkpoint directory (no config.json)")
    dev = resolve_device(device)
    tokenizer = load_tokenizer(ckpt)
    if tokens_dir is not None and (tokens_dir / "meta.json").is_file():
        _, heldout = load_token_cache(tokens_dir, tokenizer)
    elif corpus is not None and (corpus / "heldout.jsonl").is_file():
        heldout = tokenize_jsonl(corpus / "heldout.jsonl", tokenizer)
    else:
        raise FileNotFoundError("pass --tokens-dir with a token cache or --corpus with heldout.jsonl")
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).to(dev)
    heldout_t = torch.from_numpy(heldout.astype(np.int64))
    result = evaluate(model, heldout_t.to(dev), seq_len, batch_size, max_tokens)
    result["samples"] = greedy_samples(model, tokenizer, heldout_t, num=num_samples)
    return result
