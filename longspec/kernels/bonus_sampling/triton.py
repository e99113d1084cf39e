"""The bonus draw (`naive.sample_bonus_naive` states the semantics) in two launches over the whole device.

A draw by inverse CDF needs the residual's total before it can look for u x total, and a vocabulary-wide row is
too long for one program: a single program per row walking a vocabulary of float64 entries is latency-bound (as
the tree walk, kernels/tree_sampling, shows). So the row is cut into CHUNK-wide pieces:
1. one program per (row, chunk) writes its piece's residual mass and p's mass (float64);
2. one program per row picks the residual or p (the fallbacks), finds the chunk where the running mass first
   exceeds u x total, and scans that one chunk for the index.

Shape legend: B rows, N chain nodes, M nodes with q, V vocabulary, C chunks per row.

Sums run chunk by chunk, not in torch's order: a draw can differ from the reference only when u x total falls
within the last bit of a cumulative sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["sample_bonus"]

CHUNK = 1024


@triton.jit
def _weights(P, Q, TOKEN, b, stop, cols, ok, V, stride_p_b, stride_p_n, stride_q_b, stride_q_n, M,
             HAS_Q: tl.constexpr):  # fmt: skip
    """(residual after a rejection, p) at `cols` of row b's stop node, float64."""
    p = tl.load(P + b * stride_p_b + stop * stride_p_n + cols, mask=ok, other=0.0).to(tl.float64)
    if HAS_Q:
        row = tl.minimum(stop, M - 1)
        q = tl.load(Q + b * stride_q_b + row * stride_q_n + cols, mask=ok, other=0.0).to(tl.float64)
        after = tl.maximum(p - q, 0.0)
    else:
        after = tl.where(cols == tl.load(TOKEN + b), 0.0, p)
    return after, p


@triton.jit
def _chunk_mass_kernel(
    P, Q, STOP, TOKEN, MASS,
    V, M, stride_p_b, stride_p_n, stride_q_b, stride_q_n,
    HAS_Q: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    stop = tl.load(STOP + b)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    after, p = _weights(
        P, Q, TOKEN, b, stop, cols, ok, V, stride_p_b, stride_p_n, stride_q_b, stride_q_n, M, HAS_Q
    )
    tl.store(MASS + (b * 2) * CHUNKS + c, tl.sum(after, axis=0))
    tl.store(MASS + (b * 2 + 1) * CHUNKS + c, tl.sum(p, axis=0))


@triton.jit
def _draw_kernel(
    P, Q, STOP, REJECTED, TOKEN, U, MASS, BONUS,
    V, M, stride_p_b, stride_p_n, stride_q_b, stride_q_n, stride_u,
    HAS_Q: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_POW2: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    stop = tl.load(STOP + b)
    chunks = tl.arange(0, CHUNKS_POW2)
    live = chunks < CHUNKS
    after_mass = tl.load(MASS + (b * 2) * CHUNKS + chunks, mask=live, other=0.0)
    p_mass = tl.load(MASS + (b * 2 + 1) * CHUNKS + chunks, mask=live, other=0.0)
    # The residual where a draft was rejected and it has mass left, else p (naive.py says why).
    use_after = (tl.load(REJECTED + b) != 0) & (tl.sum(after_mass, axis=0) > 0)
    mass = tl.where(use_after, after_mass, p_mass)
    running = tl.cumsum(mass, axis=0)
    target = tl.load(U + b * stride_u) * tl.sum(mass, axis=0)
    # the first chunk whose running mass exceeds the target, and the mass before it
    chunk = tl.minimum(tl.sum((running <= target) & live, axis=0), CHUNKS - 1)
    before = tl.sum(tl.where(chunks == chunk - 1, running, 0.0), axis=0)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    after, p = _weights(
        P, Q, TOKEN, b, stop, cols, ok, V, stride_p_b, stride_p_n, stride_q_b, stride_q_n, M, HAS_Q
    )
    cdf = before + tl.cumsum(tl.where(use_after, after, p), axis=0)
    index = chunk * BLOCK + tl.sum((cdf <= target) & ok, axis=0)
    tl.store(BONUS + b, tl.minimum(index, V - 1))


def sample_bonus(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    stop: torch.Tensor,
    rejected: torch.Tensor,
    token: torch.Tensor,
    u: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`naive.sample_bonus_naive` in two launches: bonus [B] (long). out: an optional [B] buffer to write into."""
    batch, _, vocab = target_probs.shape
    chunks = triton.cdiv(vocab, CHUNK)
    has_q = draft_probs is not None
    q = draft_probs if has_q else target_probs  # not read without HAS_Q
    if target_probs.stride(-1) != 1 or q.stride(-1) != 1:
        target_probs, q = target_probs.contiguous(), q.contiguous()
    mass = torch.empty(batch, 2, chunks, dtype=torch.float64, device=target_probs.device)
    bonus = out if out is not None else torch.empty(batch, dtype=torch.long, device=target_probs.device)
    strides = (target_probs.stride(0), target_probs.stride(1), q.stride(0), q.stride(1))
    stop, token, rejected = stop.contiguous(), token.contiguous(), rejected.contiguous()
    _chunk_mass_kernel[(batch, chunks)](
        target_probs, q, stop, token, mass, vocab, q.shape[1], *strides,
        HAS_Q=has_q, CHUNKS=chunks, BLOCK=CHUNK,
    )  # fmt: skip
    _draw_kernel[(batch,)](
        target_probs, q, stop, rejected, token, u, mass, bonus, vocab, q.shape[1], *strides, u.stride(0),
        HAS_Q=has_q, CHUNKS=chunks, CHUNKS_POW2=triton.next_power_of_2(chunks), BLOCK=CHUNK,
    )  # fmt: skip
    return bonus
