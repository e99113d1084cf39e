"""The "math" backend: attention in plain PyTorch, float32, on any device and with grads -- the reference every
other backend is tested against; its blocked form for long sliding-window sequences (O(T * window) memory); and
the exact LSE merge of two attentions over disjoint key sets (ALGORITHM §4.2).

Shape legend: B batch, H query heads, Hkv key/value heads (H % Hkv == 0, GQA), Tq queries, Tk keys, D head dim,
Tmax static-cache slots. Layout is [B, H, T, D] everywhere; lse is [B, H, Tq] in float32, natural log.
"""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint

from longspec.modules.masks import within_window

__all__ = [
    "math_attention",
    "blocked_window_attention",
    "merge_attention",
    "default_scale",
    "needs_grad",
    "window_block",
]


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


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
            m = (
                mask.view(mask.shape[0], -1, group, Tq, mask.shape[-1])
                if mask.shape[1] == H
                else mask[:, :, None]
            )
        scores = scores.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, group, Tq]
    # exp(-inf - -inf) is NaN: give fully masked rows zero weight instead.
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe_lse[..., None])
    out = torch.matmul(probs.view(B, Hkv, group * Tq, -1), v.float()).view(B, H, Tq, D)
    return out.to(q.dtype), lse.reshape(B, H, Tq)


def window_block(window: int) -> int:
    """Query block size of `blocked_window_attention`: a block must span at least the window."""
    return max(256, window + 1)


def _window_block_attention(q, k, v, mask, scale):
    return math_attention(q, k, v, mask, scale)


def blocked_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal sliding-window self-attention (Tq == Tk) in query blocks of size Bq >= window + 1.

    A query block [s, e) only sees keys [s - window, e), so each block is an exact masked attention over at most
    Bq + window keys: memory O(T * window) instead of O(T^2). With gradients each block is recomputed in the
    backward (activation checkpointing), so only the inputs are kept. This is the path the drafter's self-attention
    takes on long training sequences when flash-attn (which has a native window) is not installed.
    """
    T = q.shape[2]
    assert k.shape[2] == T, "blocked_window_attention is for self-attention (Tq == Tk)"
    scale = default_scale(q, scale)
    block = window_block(window)
    grad = needs_grad(q, k, v)
    outs, lses = [], []
    for s in range(0, T, block):
        e = min(T, s + block)
        ks = max(0, s - window)
        q_pos = torch.arange(s, e, device=q.device)[:, None]
        k_pos = torch.arange(ks, e, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & within_window(q_pos, k_pos, window)
        args = (q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e], mask, scale)
        if grad:
            out, lse = torch.utils.checkpoint.checkpoint(_window_block_attention, *args, use_reentrant=False)
        else:
            out, lse = _window_block_attention(*args)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two attentions over disjoint key sets (docs/ALGORITHM.md §4.2):
    lse = log(e^lse_a + e^lse_b);  out = out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse).
    Works when either side is fully masked (lse = -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w_a = torch.exp(lse_a - safe)[..., None]
    w_b = torch.exp(lse_b - safe)[..., None]
    out = out_a.float() * w_a + out_b.float() * w_b
    return out.to(out_a.dtype), lse
