"""Triton kernels of the decoder layer's element-wise steps, one launch each where the eager HF modules run
several element-wise kernels (`naive.py` is the reference and states the semantics).

Shape legend: M rows (B * T tokens), N row width, B batch, T tokens, H query heads, Hkv key/value heads, D head
dim (R = D / 2, the rotary half), F MLP width.

Rounding follows the HF modules where it is cheap to: the residual sum and the normalised row are rounded to the
input dtype before the weight multiplies, as eager bf16 does; RoPE is computed in float32 and rounded once (eager
rounds each of its three products and sums), so in bf16 q/k may differ from the eager layer in the last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_rms_norm", "embed_rms_norm", "qkv_rope", "silu_mul"]


@triton.jit(do_not_specialize=["eps"])
def _add_rms_norm_kernel(
    X, R, W, Y, S, IDS,
    stride_x, stride_r, stride_y, stride_s,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, GATHER: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    if GATHER:  # X is an embedding table: the row's token's entry, also written out (the residual stream)
        x = tl.load(X + tl.load(IDS + row) * stride_x + cols, mask=ok, other=0.0)
        tl.store(S + row * stride_s + cols, x, mask=ok)
    else:
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (normed * w).to(Y.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as [M, N] without a copy when its rows are evenly strided (the usual case)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) in one pass; x, residual [..., N], weight [N] of x's
    dtype. residual None: (rms_norm(x) * weight, x). out: optional contiguous buffers for the two results (the
    second unused without a residual)."""
    N = x.shape[-1]
    assert weight.shape == (N,) and weight.dtype == x.dtype and weight.is_contiguous()
    x2 = _rows(x)
    y, total = out if out is not None else (torch.empty(x.shape, dtype=x.dtype, device=x.device), None)
    assert y.shape == x.shape and y.is_contiguous()
    y2 = y.view(-1, N)
    if residual is None:
        r2 = s2 = x2  # unused
        total = x
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        r2 = _rows(residual)
        total = torch.empty_like(y) if total is None else total
        assert total.shape == x.shape and total.is_contiguous()
        s2 = total.view(-1, N)
    M = x2.shape[0]
    if M:
        _add_rms_norm_kernel[(M,)](
            x2, r2, weight, y2, s2, y2,
            x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0),
            N, float(eps),
            HAS_RESIDUAL=residual is not None, GATHER=False, BLOCK=triton.next_power_of_2(N),
            num_warps=4 if N <= 2048 else 8,
        )  # fmt: skip
    return y, total


def embed_rms_norm(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(table[ids]) * weight, table[ids]) in one pass: ids [...] long, table [V, N] (rows contiguous),
    weight [N] of the table's dtype -> two [..., N] tensors."""
    N = table.shape[-1]
    assert table.dim() == 2 and table.stride(-1) == 1 and ids.dtype == torch.long
    assert weight.shape == (N,) and weight.dtype == table.dtype and weight.is_contiguous()
    flat = ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    y, h = torch.empty((2, *ids.shape, N), dtype=table.dtype, device=table.device).unbind(0)
    y2, h2 = y.view(-1, N), h.view(-1, N)
    if flat.numel():
        _add_rms_norm_kernel[(flat.numel(),)](
            table, table, weight, y2, h2, flat,
            table.stride(0), 0, y2.stride(0), h2.stride(0),
            N, float(eps),
            HAS_RESIDUAL=False, GATHER=True, BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 2048 else 8,
        )  # fmt: skip
    return y, h


@triton.jit(do_not_specialize=["num_tokens", "eps"])
def _qkv_rope_kernel(
    QKV, COS, SIN, QN, KN, Q, K, V, KC, VC, SLOTS,
    stride_m, stride_cb, stride_ct,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_kcb, stride_kch, stride_kct,
    stride_vcb, stride_vch, stride_vct,
    stride_sb, stride_st,
    num_tokens, num_heads, num_kv_heads, eps,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_CACHE: tl.constexpr,
):  # fmt: skip
    # One program per token: every head of its packed row [q heads | k heads | v heads] as one [heads, D] tile,
    # each head split into its two rotary halves (x1 = d < R, x2 = d >= R).
    m = tl.program_id(0).to(tl.int64)
    b = m // num_tokens
    t = m % num_tokens
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    d = tl.arange(0, BLOCK_R)
    d_ok = d < HALF
    ok = (h < num_heads + 2 * num_kv_heads)[:, None] & d_ok[None, :]
    is_q = h < num_heads
    is_k = (h >= num_heads) & (h < num_heads + num_kv_heads)
    is_v = h >= num_heads + num_kv_heads
    src = QKV + m * stride_m + h[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0)
    x2 = tl.load(src + HALF, mask=ok, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:  # per-head RMSNorm of q and k (Qwen3), rounded to the input dtype like the eager module
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.where(is_q[:, None], tl.load(QN + d, mask=d_ok)[None, :], tl.load(KN + d, mask=d_ok)[None, :])
        w2 = tl.where(
            is_q[:, None],
            tl.load(QN + HALF + d, mask=d_ok)[None, :],
            tl.load(KN + HALF + d, mask=d_ok)[None, :],
        )
        n1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1.to(tl.float32)).to(dtype).to(tl.float32)
        n2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2.to(tl.float32)).to(dtype).to(tl.float32)
        x1 = tl.where(is_v[:, None], x1, n1)
        x2 = tl.where(is_v[:, None], x2, n2)
    angle = b * stride_cb + t * stride_ct + d
    cos1 = tl.load(COS + angle, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(COS + angle + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(SIN + angle, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(SIN + angle + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    y1 = tl.where(is_v[:, None], x1, x1 * cos1 - x2 * sin1).to(dtype)  # rotate_half: (-x2, x1)
    y2 = tl.where(is_v[:, None], x2, x2 * cos2 + x1 * sin2).to(dtype)
    # Masked-off rows below compute out-of-range head offsets (and a negative slot an address before the cache);
    # they are never dereferenced.
    q_dst = Q + b * stride_qb + t * stride_qt + h[:, None] * stride_qh + d[None, :]
    k_dst = K + b * stride_kb + t * stride_kt + (h - num_heads)[:, None] * stride_kh + d[None, :]
    v_dst = (
        V + b * stride_vb + t * stride_vt + (h - num_heads - num_kv_heads)[:, None] * stride_vh + d[None, :]
    )
    tl.store(q_dst, y1, mask=ok & is_q[:, None])
    tl.store(q_dst + HALF, y2, mask=ok & is_q[:, None])
    tl.store(k_dst, y1, mask=ok & is_k[:, None])
    tl.store(k_dst + HALF, y2, mask=ok & is_k[:, None])
    tl.store(v_dst, y1, mask=ok & is_v[:, None])
    tl.store(v_dst + HALF, y2, mask=ok & is_v[:, None])
    if HAS_CACHE:  # the new K/V also go to the cache slot of this token (the write the attention would do)
        slot = tl.load(SLOTS + b * stride_sb + t * stride_st).to(tl.int64)
        # A negative slot: this token writes nothing (e.g. a ring fill's padding). (A where: the CPU interpreter
        # refuses a scalar condition `&` a block mask.)
        written = tl.where(slot >= 0, ok, False)
        kc_dst = KC + b * stride_kcb + slot * stride_kct + (h - num_heads)[:, None] * stride_kch + d[None, :]
        vc_dst = (
            VC + b * stride_vcb + slot * stride_vct + (h - num_heads - num_kv_heads)[:, None] * stride_vch
            + d[None, :]
        )  # fmt: skip
        tl.store(kc_dst, y1, mask=written & is_k[:, None])
        tl.store(kc_dst + HALF, y2, mask=written & is_k[:, None])
        tl.store(vc_dst, y1, mask=written & is_v[:, None])
        tl.store(vc_dst + HALF, y2, mask=written & is_v[:, None])


def qkv_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    skip_negative: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, (H + 2 Hkv) * D], cos/sin [B, T, D] (batch stride 0 allowed) -> q [B, H, T, D], k and v
    [B, Hkv, T, D] (new contiguous tensors, or the buffers `out`); q/k normalised per head first when
    q_norm / k_norm [D] are given. cache = (k_cache, v_cache [B, Hkv, Tmax, D], slots [B, T] integer): k and v
    are also written to slot slots[b, t] of row b (a KV cache's pending slots), rounded to the cache's dtype; a
    token whose slot is negative writes nothing there (a masked store, whatever `skip_negative` says: the flag
    is the reference's, whose masked write costs launches). One launch."""
    B, T, width = qkv.shape
    heads = num_heads + 2 * num_kv_heads
    D = width // heads
    assert width == heads * D and D % 2 == 0 and qkv.stride(-1) == 1
    assert cos.shape[-2:] == (T, D) and sin.stride() == cos.stride() and cos.stride(-1) == 1
    assert (q_norm is None) == (k_norm is None)
    rows = qkv.view(B * T, width) if qkv.is_contiguous() else qkv.reshape(B * T, width)
    if out is None:
        q = torch.empty(B, num_heads, T, D, dtype=qkv.dtype, device=qkv.device)
        k = torch.empty(B, num_kv_heads, T, D, dtype=qkv.dtype, device=qkv.device)
        out = (q, k, torch.empty_like(k))
    q, k, v = out
    assert q.shape == (B, num_heads, T, D) and k.shape == v.shape == (B, num_kv_heads, T, D)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    cos3 = cos.expand(B, T, D)
    sin3 = sin.expand(B, T, D)
    norm = q_norm if q_norm is not None else rows  # a dummy pointer when there is no norm
    if cache is not None:
        k_cache, v_cache, slots = cache
        assert (
            k_cache.shape[:2] == (B, num_kv_heads)
            and k_cache.shape[3] == D
            and v_cache.shape == k_cache.shape
        )
        assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and k_cache.dtype == v_cache.dtype
        assert slots.shape == (B, T) and not slots.dtype.is_floating_point
    else:
        k_cache = v_cache = slots = k  # dummy pointers, never read or written (HAS_CACHE=False)
    if B * T:
        _qkv_rope_kernel[(B * T,)](
            rows, cos3, sin3, norm, k_norm if k_norm is not None else rows, q, k, v, k_cache, v_cache, slots,
            rows.stride(0), cos3.stride(0), cos3.stride(1),
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            slots.stride(0), slots.stride(1),
            T, num_heads, num_kv_heads, float(eps),
            HALF=D // 2, BLOCK_H=triton.next_power_of_2(heads), BLOCK_R=triton.next_power_of_2(D // 2),
            HAS_NORM=q_norm is not None, HAS_CACHE=cache is not None, num_warps=4,
        )  # fmt: skip
    return q, k, v


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_g, stride_o, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    gate = tl.load(GU + row * stride_g + cols, mask=ok, other=0.0)
    up = tl.load(GU + row * stride_g + F + cols, mask=ok, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)  # F.silu rounds to the input dtype
    tl.store(OUT + row * stride_o + cols, (act * up).to(OUT.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [..., 2F] (gate then up) -> silu(gate) * up [..., F] in one pass (into `out` when given)."""
    F2 = gate_up.shape[-1]
    assert F2 % 2 == 0
    F = F2 // 2
    rows = _rows(gate_up)
    if out is None:
        out = torch.empty(*gate_up.shape[:-1], F, dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (*gate_up.shape[:-1], F) and out.is_contiguous()
    M = rows.shape[0]
    block = min(1024, triton.next_power_of_2(F))
    if M:
        _silu_mul_kernel[(M, triton.cdiv(F, block))](
            rows, out.view(-1, F), rows.stride(0), F, F, BLOCK=block, num_warps=4
        )
    return out
