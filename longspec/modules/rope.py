"""Rotary position embedding for arbitrary position ids, with the target's exact rope scaling.

Shape legend: B batch, H heads, T tokens, D head dim.

The inverse frequencies and the attention scaling come from transformers' own rope init functions
(`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`: linear, llama3, yarn, longrope, dynamic, ...), so the
drafter and our target loop rotate exactly like the HF model. cos/sin are computed from the position ids on the
fly (no table), because anchor-offset training positions reach 30K+ and need not be contiguous.

Two rope types change their frequencies with the sequence's length in HF, which fixed frequencies cannot follow:
"dynamic" (NTK) recomputes them once a sequence grows past `max_position_embeddings`, "longrope" switches from
its short to its long factors past `original_max_position_embeddings`. Below those lengths both agree exactly, and
`exact_positions` says where that range ends: the engine and the eval refuse to generate past it (measured on a
tiny Llama: logits off by 1e-3 (dynamic) and 8e-3 (longrope) in fp32 past the bound).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "apply_rotary", "exact_positions", "rotate_half", "rope_config"]


def _default_inv_freq(rope_parameters: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    # Same arithmetic as HF's `compute_default_rope_parameters`, so results are bit-identical.
    base = rope_parameters["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return inv_freq, 1.0


def exact_positions(hf_config) -> int | None:
    """How many positions (prompt + generated tokens) a sequence may reach while fixed frequencies rotate exactly
    as HF does for this config; None: any (the frequencies do not depend on the length)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        return getattr(hf_config, "max_position_embeddings", None)
    if rope_type == "longrope":
        original = params.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None
        )
        return original or getattr(hf_config, "max_position_embeddings", None)
    return None


def rope_config(
    *,
    rope_parameters: dict[str, Any],
    head_dim: int,
    hidden_size: int,
    num_heads: int,
    max_position_embeddings: int,
):
    """A minimal HF config carrying only what the rope init functions read (used by the drafter, which keeps
    the target's rope settings but not its whole config)."""
    from transformers import PretrainedConfig

    cfg = PretrainedConfig()
    cfg.hidden_size = hidden_size
    cfg.num_attention_heads = num_heads
    cfg.head_dim = head_dim
    cfg.max_position_embeddings = max_position_embeddings
    cfg.rope_parameters = copy.deepcopy(rope_parameters)
    return cfg


class RotaryEmbedding(nn.Module):
    """cos/sin for any position ids; `inv_freq` is a non-persistent buffer (never saved in checkpoints)."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
        rope_type: str = "default",
        exact_positions: int | None = None,
    ):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(attention_scaling)
        self.rope_type = rope_type
        self.exact_positions = exact_positions  # see `exact_positions()`

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) would round inv_freq to bf16: at position 30K the angles would be off by radians
        # (and disagree with the target's fp32 frequencies). Follow device moves only; stay float32.
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device)
        return self

    @classmethod
    def from_config(cls, hf_config) -> RotaryEmbedding:
        """Build from an HF model config (its `rope_parameters`, standardised by transformers 5.x)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(hf_config, "rope_parameters", None)
        if not params:
            raise ValueError(
                f"config of model_type {getattr(hf_config, 'model_type', '?')!r} has no rope_parameters"
            )
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            raise ValueError(
                "per-layer-type rope parameters are not supported (one rope for all layers expected)"
            )
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not supported by longspec")
        head_dim = (
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        )
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(params, head_dim)
        elif rope_type in ROPE_INIT_FUNCTIONS:
            # The init functions mutate/standardise the config they are given: hand them a copy.
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](copy.deepcopy(hf_config), None)
        else:
            raise ValueError(
                f"unknown rope_type {rope_type!r}; supported: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}"
            )
        return cls(inv_freq, scaling, rope_type, exact_positions(hf_config))

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def cos_sin(
        self, position_ids: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B,T] (or [T]) int -> (cos, sin) [B,T,D] in `dtype` (default float32).

        Angles are computed in float32 like HF: position * inv_freq, then duplicated over the two halves."""
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        # Autocast would run this product in bf16 and wreck large positions; keep it in fp32.
        with torch.autocast(device_type=position_ids.device.type, enabled=False):
            freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)  # [B,T,D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [B,T,D]
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling
        dtype = torch.float32 if dtype is None else dtype
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,H,T,D], cos/sin [B,T,D] -> x rotated (the HF "rotate_half" convention)."""
    cos = cos[:, None]
    sin = sin[:, None]
    return x * cos + rotate_half(x) * sin
