"""Model and optimisation presets of the code target, and the run config (`PretrainConfig`) built from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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
