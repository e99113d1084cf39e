"""Reference rotary angles: the semantics `triton.py` follows, and what `modules.rope.RotaryEmbedding.cos_sin`
computes off CUDA.

Shape legend: R rotary half (inv_freq's length), D = 2R rotary dims.
"""

from __future__ import annotations

import torch

__all__ = ["rope_angles_naive"]


def rope_angles_naive(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] int, inv_freq [R] float32 -> (cos, sin) [..., D] in `dtype`: HF's float32 arithmetic
    (transformers' rotary embeddings), angle = position * inv_freq duplicated over the two halves, cos and sin
    scaled by attention_scaling, then rounded once to `dtype`. Autocast must be off: it would run the product in
    bf16 and wreck large positions."""
    freqs = positions[..., None].float() * inv_freq  # [..., R]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., D]
    cos, sin = emb.cos(), emb.sin()
    if attention_scaling != 1.0:  # (x 1.0 is exact: two launches saved in every step)
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype), sin.to(dtype)
