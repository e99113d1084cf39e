"""Pretrain the project's own small Llama code target on the stdlib corpus, or evaluate one (issue 5).

    # corpus + tokenizer first (see data_prep.stdlib_corpus / data_prep.train_tokenizer), then:
    python -m launch.pretrain_target --corpus DIR --tokenizer TOKDIR --tokens-dir DIR/tokens --out CKPT \
        --preset tiny --max-minutes 3
    python -m launch.pretrain_target --tokenize-only --corpus DIR --tokenizer TOKDIR --tokens-dir DIR/tokens
    python -m launch.pretrain_target --eval-only CKPT --corpus DIR          # held-out loss/acc + greedy samples

The train split is tokenized once into a flat uint16 stream (``<s> file </s> <s> file </s> ...``), cut into packed
``seq_len`` windows (a fresh random phase each epoch), and fed to an HF ``LlamaForCausalLM`` with AdamW, linear warmup
and cosine decay. The schedule's progress is ``max(step / max_steps, elapsed / max_minutes)``, so a wall-clock budget
still ends with a decayed learning rate (that run is then no longer bit-reproducible; a step budget is). The
checkpoint with the best held-out loss is saved (bf16 safetensors + tokenizer), atomically.
"""

# Shape legend: B sequences per step, T tokens per sequence (seq_len), V vocabulary.

from __future__ import annotations

import argparse
import copy
import hashlib
import inspect
import itertools
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger("pretrain_target")

# Model shapes. `tiny` is the shipped checkpoint: bf16 weights must stay under the device transfer limit of 16 MiB
# (6 layers at intermediate 640 is 8.13M parameters, 16.3 MB); `gpu100m` is the GPU end-to-end target (~88M, 8K
# context); `smoke` exists for CPU tests.
MODEL_PRESETS: dict[str, dict] = {
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=2048),
    "tiny": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=640, max_position_embeddings=16384),
    "gpu100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                    intermediate_size=2048, max_position_embeddings=16384),
}  # fmt: skip
# Optimisation defaults per preset (a CLI flag overrides one field).
TRAIN_PRESETS: dict[str, dict] = {
    "smoke": dict(seq_len=64, batch_size=4, lr=3e-3, warmup_steps=2),
    "tiny": dict(seq_len=4096, batch_size=16, lr=2e-3, warmup_steps=100),
    "gpu100m": dict(seq_len=8192, batch_size=8, lr=8e-4, warmup_steps=200),
}


@dataclass(kw_only=True)
class PretrainConfig:
    """Everything one pretraining run needs; built once from the CLI in ``main``."""

    tokenizer: Path
    """Directory of the saved PreTrainedTokenizerFast (data_prep.train_tokenizer)."""
    tokens_dir: Path
    """Cache of the uint16 token streams ``train.npy`` / ``heldout.npy`` (built from ``corpus`` when missing)."""
    corpus: Path | None = None
    """Directory with ``train.jsonl`` / ``heldout.jsonl`` (data_prep.stdlib_corpus); only read to build the cache."""
    out: Path | None = None
    """Where the checkpoint is saved (save_pretrained layout); None = do not save."""
    preset: str = "tiny"
    """Model and optimisation preset: one of MODEL_PRESETS."""
    seq_len: int | None = None
    """Tokens per packed training sequence (None = preset default)."""
    batch_size: int | None = None
    """Sequences per optimizer step (None = preset default)."""
    lr: float | None = None
    """Peak learning rate (None = preset default)."""
    warmup_steps: int | None = None
    """Linear warmup steps (None = preset default)."""
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on norms)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    max_epochs: float = 20.0
    """Step budget in passes over the train stream; the schedule spans min(max_steps, epochs)."""
    max_steps: int | None = None
    """Hard step budget (None = from max_epochs)."""
    max_minutes: float | None = None
    """Wall-clock budget for the training loop (None = none)."""
    eval_every: int = 200
    """Held-out evaluation (and best-checkpoint tracking) every N steps."""
    eval_max_tokens: int | None = 1 << 19
    """Held-out tokens per periodic evaluation (None = all); the final evaluation uses all."""
    log_every: int = 20
    """Training log line every N steps."""
    seed: int = 0
    """Seeds init, data order and sampling."""
    device: str = "auto"
    """"auto" | "cpu" | "cuda"."""
    max_checkpoint_mb: float = 25.0
    """Refuse (before training) a model whose bf16 weights exceed this size."""
    model_overrides: dict = field(default_factory=dict)
    """LlamaConfig fields that replace the preset's (tests use this for tiny shapes)."""

    def __post_init__(self) -> None:
        if self.preset not in MODEL_PRESETS:
            raise ValueError(f"preset must be one of {sorted(MODEL_PRESETS)}, got {self.preset!r}")
        for name, value in TRAIN_PRESETS[self.preset].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.seq_len < 2 or self.batch_size < 1 or self.lr <= 0 or self.warmup_steps < 0:
            raise ValueError("seq_len >= 2, batch_size >= 1, lr > 0 and warmup_steps >= 0 are required")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"max_minutes must be > 0, got {self.max_minutes}")
        if self.max_epochs <= 0 or self.eval_every < 1 or self.log_every < 1:
            raise ValueError("max_epochs > 0, eval_every >= 1 and log_every >= 1 are required")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto|cpu|cuda, got {self.device!r}")


# ----------------------------------------------------------------------------------------------------------- data


def load_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    if not (Path(path) / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {path}: run `python -m data_prep.train_tokenizer` first"
        )
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def tokenizer_digest(tokenizer) -> str:
    """Identity of a tokenizer's vocabulary, stored beside the token cache to catch stale caches."""
    # The sorted vocabulary, not the serialized tokenizer.json: its layout changes between `tokenizers` versions.
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode("utf-8")).hexdigest()[:16]


def tokenize_jsonl(jsonl: Path, tokenizer, *, batch_files: int = 64) -> np.ndarray:
    """``<s> ids </s>`` per ``text`` row, concatenated into one uint16 stream (vocabularies up to 65536)."""
    if len(tokenizer) > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"vocabulary of {len(tokenizer)} does not fit the uint16 token cache")
    with open(jsonl, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    eos = tokenizer.eos_token_id
    chunks = []
    for i in range(0, len(texts), batch_files):
        # The backend tokenizer (not __call__) so long files raise no model_max_length warning; the post-processor
        # still prepends <s>, as tokenizer(text) does at inference.
        for enc in tokenizer.backend_tokenizer.encode_batch(texts[i : i + batch_files]):
            chunks.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)


def build_token_cache(corpus: Path | None, tokenizer, tokens_dir: Path) -> dict:
    """Tokenize ``corpus/{train,heldout}.jsonl`` into ``tokens_dir/{train,heldout}.npy`` + ``meta.json``."""
    if corpus is None or not (corpus / "train.jsonl").is_file():
        raise FileNotFoundError(
            f"no token cache in {tokens_dir} and no corpus to build it from ({corpus}/train.jsonl): "
            "run `python -m data_prep.stdlib_corpus --out DIR` and pass --corpus DIR"
        )
    tokens_dir.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer_digest": tokenizer_digest(tokenizer), "vocab_size": len(tokenizer), "tokens": {}}
    for split in ("train", "heldout"):
        ids = tokenize_jsonl(corpus / f"{split}.jsonl", tokenizer)
        np.save(tokens_dir / f"{split}.npy", ids)
        meta["tokens"][split] = int(ids.size)
    manifest = corpus / "manifest.json"
    if manifest.is_file():
        meta["corpus_python_version"] = json.loads(manifest.read_text())["python_version"]
    (tokens_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_token_cache(
    tokens_dir: Path, tokenizer, corpus: Path | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The train / held-out uint16 streams, built first if missing; a cache from another tokenizer is an error."""
    meta_path = tokens_dir / "meta.json"
    if not meta_path.is_file():
        build_token_cache(corpus, tokenizer, tokens_dir)
    meta = json.loads(meta_path.read_text())
    if meta["tokenizer_digest"] != tokenizer_digest(tokenizer):
        raise ValueError(
            f"token cache {tokens_dir} was built with another tokenizer: delete it or pass another dir"
        )
    return np.load(tokens_dir / "train.npy"), np.load(tokens_dir / "heldout.npy")


class PackedStream:
    """Packed ``T+1``-token windows over one token stream, shuffled per epoch with a random phase.

    The phase (0..T-1) moves window boundaries between epochs so every token is, over time, seen with long context.
    """

    def __init__(self, ids: torch.Tensor, seq_len: int, batch_size: int, generator: torch.Generator):
        if ids.numel() < seq_len + 1 + seq_len:
            raise ValueError(f"train stream of {ids.numel()} tokens is too short for seq_len {seq_len}")
        self.ids, self.seq_len, self.batch_size, self.gen = ids, seq_len, batch_size, generator
        self.offsets = torch.arange(seq_len + 1, device=ids.device)
        self.epoch, self._order, self._pos = 0, None, 0

    @property
    def windows_per_epoch(self) -> int:
        return (self.ids.numel() - 1 - self.seq_len) // self.seq_len  # phase may take up to T-1 tokens

    def _new_epoch(self) -> None:
        phase = int(torch.randint(self.seq_len, (1,), generator=self.gen))
        starts = phase + self.seq_len * torch.arange(self.windows_per_epoch)
        self._order = starts[torch.randperm(starts.numel(), generator=self.gen)].to(self.ids.device)
        self._pos = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [B,T], labels [B,T])`` as int64 on the stream's device."""
        if self._order is None or self._pos + self.batch_size > self._order.numel():
            if self._order is not None:
                self.epoch += 1
            self._new_epoch()
        starts = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        window = self.ids[starts[:, None] + self.offsets]  # [B, T+1]
        return window[:, :-1], window[:, 1:]


# ---------------------------------------------------------------------------------------------------------- model


def build_model_config(preset: str, vocab_size: int, tokenizer=None, **overrides):
    from transformers import LlamaConfig

    fields = dict(MODEL_PRESETS[preset], **overrides)
    special = {}
    if tokenizer is not None:
        special = dict(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return LlamaConfig(
        vocab_size=vocab_size,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,  # the drafter shares embed_tokens and lm_head; keep them distinct like big targets
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
        **special,
        **fields,
    )


def num_parameters(config) -> int:
    """Parameters of a LlamaForCausalLM with this config, without building it."""
    d, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    attn = d * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    per_layer = attn + 3 * d * i + 2 * d
    embeddings = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    return layers * per_layer + embeddings + d


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


# ------------------------------------------------------------------------------------------------------- training


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


def save_checkpoint(model, tokenizer, out: Path, summary: dict) -> Path:
    """bf16 safetensors + config + tokenizer + metrics.json, written to a temp dir and renamed into place."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = copy.deepcopy(model).to("cpu", torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out / "model.safetensors"


# ----------------------------------------------------------------------------------------------------------- eval


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


# ------------------------------------------------------------------------------------------------------------ CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--corpus", type=Path, help="dir with train.jsonl/heldout.jsonl (data_prep.stdlib_corpus)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer dir (data_prep.train_tokenizer)")
    p.add_argument("--tokens-dir", type=Path, help="uint16 token cache (default: CORPUS/tokens)")
    p.add_argument("--out", type=Path, help="checkpoint output dir")
    p.add_argument("--preset", default="tiny", choices=sorted(MODEL_PRESETS))
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-epochs", type=float, default=20.0)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--max-minutes", type=float)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, help="torch CPU threads (e.g. 1 on a shared machine)")
    p.add_argument("--max-checkpoint-mb", type=float, default=25.0)
    p.add_argument("--tokenize-only", action="store_true", help="build the token cache and exit")
    p.add_argument("--eval-only", type=Path, metavar="CKPT", help="evaluate a saved checkpoint and exit")
    p.add_argument("--eval-seq-len", type=int, default=1024, help="--eval-only window length")
    p.add_argument("--eval-max-tokens", type=int, help="--eval-only: held-out tokens to score (default all)")
    p.add_argument("--num-samples", type=int, default=3, help="--eval-only: greedy continuations to print")
    p.add_argument("--summary-json", type=Path, help="also write the run's summary / eval result here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens_dir = args.tokens_dir or (args.corpus / "tokens" if args.corpus else None)

    if args.eval_only is not None:
        result = eval_checkpoint(
            args.eval_only, tokens_dir=tokens_dir, corpus=args.corpus, seq_len=args.eval_seq_len,
            batch_size=args.batch_size or 4, device=args.device, num_samples=args.num_samples,
            max_tokens=args.eval_max_tokens,
        )  # fmt: skip
        for i, s in enumerate(result["samples"]):
            print(f"--- sample {i}: distinct {s['distinct_ratio']:.2f}, longest run {s['longest_run']}, "
                  f"token match {s['token_match']:.2f}\n[prefix ...]{s['prefix_tail']}[greedy ->]{s['continuation']}")  # fmt: skip
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
        if args.summary_json:
            args.summary_json.write_text(json.dumps(result, indent=2) + "\n")
        return

    if args.tokenizer is None or tokens_dir is None:
        raise ValueError("--tokenizer and --tokens-dir (or --corpus) are required to train")
    tokenizer = load_tokenizer(args.tokenizer)
    train_ids, heldout_ids = load_token_cache(tokens_dir, tokenizer, args.corpus)
    if args.tokenize_only:
        print(
            json.dumps(
                {
                    "tokens_dir": str(tokens_dir),
                    "train": int(train_ids.size),
                    "heldout": int(heldout_ids.size),
                }
            )
        )
        return
    cfg = PretrainConfig(
        tokenizer=args.tokenizer, tokens_dir=tokens_dir, corpus=args.corpus, out=args.out, preset=args.preset,
        seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, max_epochs=args.max_epochs, max_steps=args.max_steps,
        max_minutes=args.max_minutes, eval_every=args.eval_every, log_every=args.log_every, seed=args.seed,
        device=args.device, max_checkpoint_mb=args.max_checkpoint_mb,
    )  # fmt: skip
    model, summary = train(cfg, train_ids, heldout_ids, tokenizer)
    heldout_t = torch.from_numpy(heldout_ids.astype(np.int64))
    summary["samples"] = greedy_samples(model, tokenizer, heldout_t)
    for s in summary["samples"]:
        log.info("greedy sample: distinct %.2f longest run %d token match %.2f: %r",
                 s["distinct_ratio"], s["longest_run"], s["token_match"], s["continuation"][:200])  # fmt: skip
    if cfg.out is not None:
        weights = save_checkpoint(model, tokenizer, cfg.out, summary)
        size_mb = weights.stat().st_size / 1e6
        log.info("saved %s (%.2f MB)", cfg.out, size_mb)
        if size_mb > cfg.max_checkpoint_mb:
            raise ValueError(
                f"{weights} is {size_mb:.1f} MB, over --max-checkpoint-mb {cfg.max_checkpoint_mb}"
            )
    if args.summary_json:
        args.summary_json.write_text(json.dumps(summary, indent=2) + "\n")
    print(
        json.dumps({k: summary[k] for k in ("steps", "best_step", "tokens_seen", "train_seconds", "heldout")})
    )


if __name__ == "__main__":
    sys.exit(main())
