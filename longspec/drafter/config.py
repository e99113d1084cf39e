"""The drafter block's shapes (`DrafterConfig`): everything but the window is copied from the target's HF config,
plus the target fingerprint the checkpoint is checked against (longspec.fingerprint)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from longspec.fingerprint import target_fingerprint

__all__ = ["DrafterConfig", "read_config"]


DEFAULT_WINDOW = 512  # the paper's drafter window: the one default that train and eval configs refer to


@dataclass(kw_only=True)
class DrafterConfig:
    """Shapes of the drafter block; everything but `window` mirrors the target (`from_target_config`)."""

    hidden_size: int  # model width Dm (the target's: the drafter reads its embeddings and feeds its LM head)
    num_heads: int  # query heads H
    num_kv_heads: int  # key/value heads Hkv (must equal the target's: cross-attention reads its KV as is)
    head_dim: int  # D
    intermediate_size: int  # SwiGLU width F
    vocab_size: int  # V of the shared embedding / LM head
    rope_parameters: dict[str, Any]  # the target's standardised HF rope parameters (type, theta, scaling)
    max_position_embeddings: int  # the target's context length (some rope types read it)
    rms_norm_eps: float = 1e-6  # epsilon of the three RMSNorms
    attention_bias: bool = False  # bias on the q/k/v projections (as the target: Qwen2 has it)
    qk_norm: bool = False  # RMSNorm over the head dim on q and k before RoPE (as the target: Qwen3)
    hidden_act: str = "silu"  # MLP activation; SwiGLU needs "silu"
    window: int = DEFAULT_WINDOW  # self-attention: the token + `window` previous tokens; ring-buffer slots
    target_fingerprint: dict[str, Any] = field(default_factory=dict)  # see longspec.fingerprint
    # the reduced draft vocabulary (longspec.drafter.vocab): its size K and the sha256 of its id map, saved beside
    # the weights; None: the drafter scores the target's whole vocabulary
    draft_vocab_size: int | None = None
    draft_vocab_sha256: str | None = None

    def __post_init__(self):
        for name in (
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "window",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DrafterConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.hidden_act != "silu":
            raise ValueError(f"the drafter MLP is SwiGLU: hidden_act must be 'silu', got {self.hidden_act!r}")
        # Types a hand-edited / damaged config.json can get wrong (a TypeError or AttributeError later, else).
        if not isinstance(self.rope_parameters, dict):
            raise ValueError(f"rope_parameters must be a dict, got {self.rope_parameters!r}")
        if not isinstance(self.target_fingerprint, dict):
            raise ValueError(f"target_fingerprint must be a dict, got {self.target_fingerprint!r}")
        if (self.draft_vocab_size is None) != (self.draft_vocab_sha256 is None):
            raise ValueError(
                "draft_vocab_size and draft_vocab_sha256 come together (a draft vocabulary) or not at all"
            )
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size!r}"
            )
        if "rope_theta" not in self.rope_parameters:
            raise ValueError(f"rope_parameters needs a rope_theta, got {self.rope_parameters!r}")

    @classmethod
    def from_target_config(cls, hf_config, *, window: int = DEFAULT_WINDOW, tokenizer=None) -> DrafterConfig:
        """Derive the block's shapes from an HF target config (fingerprinted, with the tokenizer if given)."""
        from longspec.target import _check_model_type

        family = _check_model_type(hf_config)
        head_dim = (
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        )
        return cls(
            hidden_size=hf_config.hidden_size,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=hf_config.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            vocab_size=hf_config.vocab_size,
            rope_parameters=dict(hf_config.rope_parameters),
            max_position_embeddings=hf_config.max_position_embeddings,
            rms_norm_eps=hf_config.rms_norm_eps,
            # Qwen2 configs have no `attention_bias`: its q/k/v projections always carry a bias.
            attention_bias=family == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=family == "qwen3",
            hidden_act=getattr(hf_config, "hidden_act", "silu"),
            window=window,
            target_fingerprint=target_fingerprint(hf_config, tokenizer),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown DrafterConfig fields {unknown} (a config.json from a newer longspec?)")
        return cls(**data)


def read_config(config_path: str) -> DrafterConfig:
    """A saved drafter's config.json. A damaged or foreign file is one ValueError naming it, not a
    JSONDecodeError / TypeError that names none."""
    try:
        with open(config_path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{config_path} is not valid JSON ({e}): not a drafter config, or damaged") from e
    if not isinstance(data, dict):
        raise ValueError(f"{config_path} holds a JSON {type(data).__name__}, not a drafter config object")
    data.pop("architecture", None)
    try:
        config = DrafterConfig.from_dict(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{config_path} is not a valid drafter config: {e}") from e
    return config
