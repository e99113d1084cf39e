"""Plain-PyTorch references of `layer_ops`, written with the HF Llama arithmetic (each step rounded to the input
dtype where the HF modules round), so in bf16 they reproduce the unfused layer exactly.

Shape legend: M rows (B * T tokens), Dm model width, B batch, T tokens, H query heads, Hkv key/value heads,
D head dim, F MLP width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_naive(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, round to x's dtype, then scale by the weight."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_naive(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); x, residual [..., Dm]. residual None: (rms_norm(x), x)."""
    total = x if residual is None else residual + x
    return rms_norm_naive(total, weight, eps), total


def embed_rms_norm_naive(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(table[ids]), table[ids]): a forward's first norm, over its token embeddings."""
    return add_rms_norm_naive(F.embedding(ids, table), None, weight, eps)


def qkv_rope_naive(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    skip_negative: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, (H + 2 Hkv) * D] (the packed projection: q heads, then k heads, then v heads), cos/sin
    [B, T, R] (R = D, or fewer rotary dims: `rotate`) -> q [B, H, T, D], k [B, Hkv, T, D] rotated (after the per-head RMSNorm q_norm / k_norm [D] when
    given: Qwen3), v [B, Hkv, T, D]. cache = (k_cache, v_cache [B, Hkv, Tmax, D], slots [B, T]): k and v are
    also written there (`write_kv`; with `skip_negative`, a token whose slot is negative writes nothing)."""
    B, T, _ = qkv.shape
    D = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.view(B, T, -1, D).split([num_heads, num_kv_heads, num_kv_heads], dim=2)
    if q_norm is not None:
        q = rms_norm_naive(q, q_norm, eps)
    if k_norm is not None:
        k = rms_norm_naive(k, k_norm, eps)
    q = rotate(q.transpose(1, 2), cos, sin)
    k = rotate(k.transpose(1, 2), cos, sin)
    v = v.transpose(1, 2)
    if cache is not None:
        write_kv(*cache, k, v, skip_negative=skip_negative)
    return q, k, v


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    skip_negative: bool = False,
) -> None:
    """k/v [B, Hkv, T, D] into k_cache / v_cache [B, Hkv, Tmax, D] (rounded to their dtype) at slots [B, T] (per
    row, distinct within a row; >= 0 unless `skip_negative`, where a token whose slot is negative writes nothing:
    a ring fill's padding). A target's slots never are: its write is one scatter per tensor, where the masked
    write below takes ~13 launches.

    Fixed shapes, no host sync (a CUDA graph replays it): with `skip_negative` a skipped token rewrites the slot
    of its row's highest-slot token with that token's K/V, the same bytes, so the scatter's order cannot matter;
    in a row that writes nothing, it rewrites slot 0 with what slot 0 holds."""
    if not skip_negative:
        index = slots[:, None, :, None].expand_as(k)
        k_cache.scatter_(2, index, k.to(k_cache.dtype))
        v_cache.scatter_(2, index, v.to(v_cache.dtype))
        return
    keep = slots >= 0  # [B, T]
    top, top_token = slots.max(1, keepdim=True)  # [B, 1]: each row's highest slot and the token writing it
    writes = (top >= 0)[:, None, :, None]  # [B, 1, 1, 1]: the row writes some token
    index = torch.where(keep, slots, top.clamp(min=0))[:, None, :, None].expand_as(k)
    keep, top_token = keep[:, None, :, None], top_token[:, None, :, None].expand(*k.shape[:2], 1, k.shape[3])
    for cache, new in ((k_cache, k), (v_cache, v)):
        new = new.to(cache.dtype)
        repeat = torch.where(writes, new.gather(2, top_token), cache[:, :, :1])  # [B, Hkv, 1, D]
        cache.scatter_(2, index, torch.where(keep, new, repeat))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated by cos/sin [B, T, R] in the HF "rotate_half" convention, op by op as HF rounds; a
    partial rope (R < D) rotates the first R dims and passes the rest through."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([rotate(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def silu_mul_naive(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2F] (the packed gate and up projections) -> silu(gate) * up [..., F]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
