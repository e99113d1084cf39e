"""The FlashAttention-2 forward inner loop shared by our attention kernels (Triton device functions).

Shape legend: M query rows of one program (BLOCK_M), N keys per tile (BLOCK_N), D head dim (BLOCK_D >= HEAD_DIM).

Online softmax in base 2, with the softmax scale folded into qk_scale = scale * log2(e) (Dao 2023, Alg. 1):

    s_j = qk_scale * q . k_j,   m' = max(m, max_j s_j),
    l' = l 2^(m - m') + sum_j 2^(s_j - m'),   acc' = acc 2^(m - m') + sum_j 2^(s_j - m') v_j,
    finally  out = acc / l,  lse (natural log) = ln 2 * (m + log2 l).

A row that has seen no visible key keeps m = -inf, l = 0, acc = 0; while m is -inf it is replaced by 0 in the
exponents so that 2^(-inf - -inf) never appears. Full tiles run without any mask (the hot loop); only the
last, ragged tile and masked (tree) tiles pay for bounds and visibility checks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longspec.kernels.mask_layout import aligned_rows


def mask_operand(mask: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A bool mask [Tq, Tk] or [B, Tq, Tk] as the kernels read it: uint8 with unit key stride and rows aligned
    to 16 bytes, so each row's tile loads as wide vectors. Returns (mask_u8, batch stride, row stride).

    A mask that is not laid out so is copied once per call (one small kernel, `mask_layout.aligned_rows`);
    callers that reuse a mask across layers lay it out once with `aligned_rows` themselves."""
    m = aligned_rows(mask).view(torch.uint8)  # same bytes
    batch_stride = 0 if m.dim() == 2 or m.shape[0] == 1 else m.stride(0)
    return m, batch_stride, m.stride(-2)


def heads_last_like(q: torch.Tensor) -> torch.Tensor:
    """An output for attention of q [B, H, Tq, D], laid out [B, Tq, H, D] in memory (returned as a [B, H, Tq, D]
    view): the layout the output projection reads, so `out.transpose(1, 2).reshape(B, Tq, H * D)` is a view.
    In the default layout that reshape is one copy kernel per layer whenever Tq > 1 (every verify and every draft
    level), launches a decode round would pay for nothing."""
    B, H, Tq, D = q.shape
    return q.new_empty(B, Tq, H, D).transpose(1, 2)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact float32 products for float32 inputs (Triton would use TF32 otherwise);
    fp16/bf16 products are exact in the float32 accumulator anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def attend_range(
    acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, mask_base,
    start, end, qk_scale, d, limit,
    HAS_MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_LIMIT: tl.constexpr, period=1, HAS_PERIOD: tl.constexpr = False,
):  # fmt: skip
    """Fold keys [start, end) of one kv head into (acc [M, D], m_i [M], l_i [M]) for the rows of q [M, D].

    k_base/v_base point at key 0 of the head; mask_base is a [M, 1] pointer tile to each row's mask row
    (used when HAS_MASK: key j visible iff mask_base[j] != 0; see `mask_operand`); limit [M] is each row's end
    (used when HAS_LIMIT: key j visible iff j < limit, a causal diagonal computed from indices, no loads).
    HAS_PERIOD (with HAS_LIMIT) also needs (limit - 1 - j) % period == 0: every period-th key back from the
    row's last one, i.e. one branch of a forest of chains laid out level by level (`split_kv_attn`'s `branches`).
    Both default off, so the other kernels' calls compile as before."""
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = d < HEAD_DIM
    end = tl.maximum(end, start)  # an empty range must not turn into a negative tile count
    if HAS_MASK or HAS_LIMIT:
        end_full = start  # every tile needs the visibility mask
    else:
        end_full = start + (end - start) // BLOCK_N * BLOCK_N

    for start_n in range(start, end_full, BLOCK_N):
        # 64-bit scalar offset (a 128K cache with wide strides overflows int32); small int32 per-element ones.
        k_ptrs = k_base + tl.cast(start_n, tl.int64) * stride_kt + offs_n[:, None] * stride_kt + d[None, :]
        v_ptrs = v_base + tl.cast(start_n, tl.int64) * stride_vt + offs_n[:, None] * stride_vt + d[None, :]
        if BLOCK_D == HEAD_DIM:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every key of a full tile is visible
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    for start_n in range(end_full, end, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < end
        # Clamp instead of predicating: every address stays inside [start, end), so no garbage (or NaN) from
        # unfilled slots is read, the loads need no mask registers, and out-of-range columns get -inf below.
        rows_kv = tl.minimum(cols, end - 1)
        k_ptrs = k_base + rows_kv[:, None].to(tl.int64) * stride_kt + d[None, :]
        v_ptrs = v_base + rows_kv[:, None].to(tl.int64) * stride_vt + d[None, :]
        if BLOCK_D == HEAD_DIM:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = col_ok[None, :]
        if HAS_MASK:
            m_ptrs = mask_base + start_n + offs_n[None, :]
            visible = visible & (tl.load(m_ptrs, mask=visible, other=0) != 0)
        if HAS_LIMIT:
            visible = visible & (cols[None, :] < limit[:, None])
            if HAS_PERIOD:
                # (limit - 1 - col) % period == 0, as one remainder per row and one per column (both >= 0), in
                # int32: GPUs have no integer divide, and one int64 remainder per element (limit is int64) is a
                # long emulated sequence for every key of the tile, enough to make a forest's round markedly
                # dearer than a chain's.
                row_phase = ((limit - 1).to(tl.int32) % period)[:, None]
                col_phase = (cols.to(tl.int32) % period)[None, :]
                visible = visible & (row_phase == col_phase)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
