"""Attention under an arbitrary boolean mask (the draft tree's ancestor mask), returning LSE.

Shape legend: B batch, H query heads, Hkv key/value heads, G = H / Hkv (GQA group), Tq queries, Tk keys
(both up to a few hundred), D head dim, R = G * Tq rows per kv head.

The GQA group is folded into the query rows (row r -> head kvh*G + r // Tq, query r % Tq) so the group's heads
share each K/V tile; the mask is read blockwise next to its score tile. A [Tq, Tk] mask is shared by the batch
(batch stride 0); a [B, Tq, Tk] mask gives each row its own tree (a batch of sequences drafting different
trees) in the same launch: only the mask's batch stride differs, the grid does not. The loop
is the FlashAttention-2 forward of `longspec.kernels.online_softmax` (base-2 online softmax, float32
accumulation). A row whose keys are all masked returns out = 0, lse = -inf.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from longspec.kernels.online_softmax import attend_range, dot_precision, heads_last_like, mask_operand

_LOG2E = 1.4426950408889634


# Sizes are not specialised on (== 1, divisibility by 16): one compiled kernel for every tree size.
@triton.jit(do_not_specialize=["num_queries", "num_keys", "num_rows"])
def _fused_mask_attn_kernel(
    Q, K, V, MASK, OUT, LSE,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_mb, stride_mq,
    stride_ob, stride_oh, stride_ot,
    stride_lb, stride_lh, stride_lt,
    num_kv_heads, num_queries, num_keys, group, num_rows,
    qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # folded (head, query) rows
    heads = (kvh * group + rows // num_queries).to(tl.int64)
    tq = (rows % num_queries).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + tq[:, None] * stride_qt + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q,
        K + b * stride_kb + kvh * stride_kh, V + b * stride_vb + kvh * stride_vh, stride_kt, stride_vt,
        MASK + b * stride_mb + tq[:, None] * stride_mq,
        0, num_keys, qk_scale, d, tq,  # (no limit: HAS_LIMIT is off)
        HAS_MASK=True, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
        HAS_LIMIT=False,
    )  # fmt: skip

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_i)) * 0.6931471805599453)
    tl.store(
        OUT + b * stride_ob + heads[:, None] * stride_oh + tq[:, None] * stride_ot + d[None, :],
        o.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(LSE + b * stride_lb + heads * stride_lh + tq * stride_lt, lse, mask=row_ok)


def fused_mask_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,H,Tq,D], k/v [B,Hkv,Tk,D], mask bool [Tq,Tk] (shared) or [B,Tq,Tk] (one per row; True = visible).
    out/lse: optional output buffers. Returns (out [B,H,Tq,D] in q.dtype (or out's; by default laid out
    [B,Tq,H,D]: `heads_last_like`), lse [B,H,Tq] float32). block_m: folded rows per program (default: the rows
    rounded up to a power of two within [16, 64]: a drafter level of a few rows is one program per kv head that
    walks every key tile, and a 64-row tile of mostly padding would multiply each step's work). block_n: keys
    per tile (default 128 over a drafter's ring of a few hundred keys at head dim <= 64, where a program walks
    half as many tiles: `benchmarks/mask_attn_sweep.py` finds it ~10% faster than 64 at the SmolLM2 and Qwen
    shapes; else 64)."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    assert k.shape == v.shape and k.shape[0] == B and k.shape[3] == D and H % Hkv == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "head dim must be contiguous"
    assert mask.dtype == torch.bool and tuple(mask.shape[-2:]) == (Tq, Tk)
    assert mask.dim() == 2 or (mask.dim() == 3 and mask.shape[0] in (1, B)), "mask [Tq,Tk], [1|B,Tq,Tk]"
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    group = H // Hkv
    num_rows = group * Tq
    if block_m is None:
        block_m = min(64, max(16, triton.next_power_of_2(num_rows)))
    if block_n is None:
        block_n = 128 if Tk >= 256 and D <= 64 else 64
    mask_u8, stride_mb, stride_mq = mask_operand(mask)

    out = heads_last_like(q) if out is None else out
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device) if lse is None else lse
    assert out.shape == q.shape and out.stride(-1) == 1 and lse.shape == (B, H, Tq)
    grid = (triton.cdiv(num_rows, block_m), B * Hkv)
    _fused_mask_attn_kernel[grid](
        q, k, v, mask_u8, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        stride_mb, stride_mq,
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        Hkv, Tq, Tk, group, num_rows,
        scale * _LOG2E,
        HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
    )  # fmt: skip
    return out, lse
