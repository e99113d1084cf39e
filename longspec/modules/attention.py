"""Attention backends behind one API, each returning (out, lse).

Shape legend: B batch, H query heads, Hkv key/value heads (H % Hkv == 0, GQA), Tq queries, Tk keys, D head dim.
Layout is [B, H, T, D] everywhere (the SDPA layout); lse is [B, H, Tq] in float32, natural log.

Causal alignment is bottom-right: query i sits at key position Tk - Tq + i, so a block of new queries
against [cache ++ new] keys needs no offset argument. A key j is visible to the query at position t iff
j <= t and (window is None or t - j <= window)  -- "the token + `window` previous tokens".
Rows with no visible key return out = 0 and lse = -inf.

NOTE: this file currently holds the plain-PyTorch math backend (the reference). The flash-attn, torch-flash
and Triton paths are added behind the same functions (issue 2).
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention", "merge_attention", "visibility_mask", "math_attention"]


def visibility_mask(
    num_queries: int, num_keys: int, *, causal: bool, window: int | None, device: torch.device | None = None
) -> torch.Tensor | None:
    """[Tq, Tk] bool mask (True = visible) for bottom-right causal / sliding-window attention."""
    if not causal and window is None:
        return None
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    k_pos = torch.arange(num_keys, device=device)[None, :]
    mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
    if causal:
        mask &= k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) <= window
    return mask


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention in float32. mask: broadcastable to [B, H, Tq, Tk], True = visible."""
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    assert H % Hkv == 0, f"query heads {H} not a multiple of kv heads {Hkv}"
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    group = H // Hkv
    # Fold the GQA group into the query axis instead of repeating K/V.
    qf = q.float().reshape(B, Hkv, group * Tq, D)
    scores = torch.matmul(qf, k.float().transpose(-1, -2)) * scale  # [B, Hkv, group*Tq, Tk]
    scores = scores.view(B, Hkv, group, Tq, -1)
    if mask is not None:
        if mask.dim() == 2:  # [Tq, Tk]
            m = mask[None, None, None]
        elif mask.dim() == 3:  # [B, Tq, Tk]
            m = mask[:, None, None]
        else:  # [B, H, Tq, Tk]
            m = mask.view(mask.shape[0], -1, group, Tq, mask.shape[-1]) if mask.shape[1] == H else mask[:, :, None]
        scores = scores.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, group, Tq]
    # exp(-inf - -inf) is NaN: give fully masked rows zero weight instead.
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe_lse[..., None])
    out = torch.matmul(probs.view(B, Hkv, group * Tq, -1), v.float()).view(B, H, Tq, D)
    return out.to(q.dtype), lse.reshape(B, H, Tq)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal / sliding-window / unmasked attention. Returns (out [B,H,Tq,D] in q.dtype, lse [B,H,Tq] fp32)."""
    mask = visibility_mask(q.shape[2], k.shape[2], causal=causal, window=window, device=q.device)
    return math_attention(q, k, v, mask, scale)


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two attentions over disjoint key sets (REFERENCE §4):
    lse = log(e^lse_a + e^lse_b);  out = out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse).
    Works when either side is fully masked (lse = -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w_a = torch.exp(lse_a - safe)[..., None]
    w_b = torch.exp(lse_b - safe)[..., None]
    out = out_a.float() * w_a + out_b.float() * w_b
    return out.to(out_a.dtype), lse
