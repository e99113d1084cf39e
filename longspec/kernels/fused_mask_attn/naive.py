"""Plain-PyTorch float32 reference for `fused_mask_attn`: attention under an arbitrary boolean mask.

Shape legend: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), Tq queries, Tk keys, D head dim.

    s_ij = scale * q_i . k_j   if mask_ij else -inf
    lse_i = log sum_j exp(s_ij),   out_i = sum_j exp(s_ij - lse_i) v_j
A row with no visible key has lse = -inf and out = 0.
"""

from __future__ import annotations

import torch


def fused_mask_attn_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,H,Tq,D], k/v [B,Hkv,Tk,D], mask [Tq,Tk] or [B,Tq,Tk] bool (True = visible).
    Returns (out [B,H,Tq,D] float32, lse [B,H,Tq] float32)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [B, H, Tk, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k) * scale  # [B, H, Tq, Tk]
    visible = mask[None, None] if mask.dim() == 2 else mask[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Tq]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # fully masked rows: -inf - -inf = NaN -> 0
    return probs @ v, lse
