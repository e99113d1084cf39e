"""`naive.row_softmax_naive` in two launches over the whole device.

`torch.softmax` reduces a row in one thread block, so a few vocabulary-wide rows leave the GPU almost idle (its
time is far above what the row's bytes need: `benchmarks/decode_methods.py --profile`). Here each row
is cut into CHUNK-wide pieces c (the online softmax's rescaling, as in flash attention, over chunks instead of key
blocks):
1. one program per (row, chunk) writes m_c = max_{i in c} x_i and s_c = sum_{i in c} exp(x_i - m_c);
2. one program per (row, chunk) combines its row's stats, M = max_c m_c and S = sum_c s_c exp(m_c - M)
   (= sum_i exp(x_i - M)), and writes exp(x_i - M) / S for its chunk.
Its effect on a round's time: `benchmarks/round_latency.py --round-costs`.

Everything runs in float32. The sums run in another order than torch's (and Triton's exp on CUDA is the fast
ex2-based one), so results differ from the reference in the last bits; see the package docstring for why that
keeps sampling lossless.

Masking: a chunk of only -inf has s_c = 0 (its m_c = -inf is not subtracted from itself), so a -inf entry gives
exactly 0 and a row with one finite entry gives exactly 1 there. NaN as torch: a row holding a NaN or a +inf, or
with every entry -inf, is NaN throughout (a NaN / +inf makes its chunk's s_c NaN, an all -inf row's M makes
exp(x_i - M) NaN).

Shape legend: R rows (the leading dims flattened), V vocabulary, C chunks per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["row_softmax_triton"]

CHUNK = 2048


@triton.jit
def _chunk_stats_kernel(X, MAX, SUM, V, stride_x, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + r * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    # An all -inf chunk shifts by 0, not by -inf: exp(-inf) = 0 rather than exp(-inf + inf) = NaN.
    shift = tl.where(top == float("-inf"), 0.0, top)
    tl.store(MAX + r * CHUNKS + c, top)
    tl.store(SUM + r * CHUNKS + c, tl.sum(tl.exp(x - shift), axis=0))


@triton.jit
def _normalize_kernel(
    X, MAX, SUM, OUT, V, stride_x, CHUNKS: tl.constexpr, CHUNKS_POW2: tl.constexpr, BLOCK: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    chunks = tl.arange(0, CHUNKS_POW2)
    ok = chunks < CHUNKS
    tops = tl.load(MAX + r * CHUNKS + chunks, mask=ok, other=float("-inf"))
    sums = tl.load(SUM + r * CHUNKS + chunks, mask=ok, other=0.0)
    row_max = tl.max(tops, axis=0)
    # Every program of a row sums the same chunks in the same order: one S per row.
    total = tl.sum(tl.where(ok, sums * tl.exp(tops - row_max), 0.0), axis=0)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    keep = cols < V
    x = tl.load(X + r * stride_x + cols, mask=keep, other=float("-inf")).to(tl.float32)
    tl.store(OUT + r * V + cols, tl.exp(x - row_max) / total, mask=keep)


def row_softmax_triton(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of x [..., V] (bf16 / fp16 / fp32, computed in float32) -> [..., V] float32, in
    two launches. A 2-d x is read through its row stride (no copy of a [R, V] view); the last dim must be
    contiguous, else it is copied."""
    *lead, vocab = x.shape
    rows2d = x if x.dim() == 2 else x.reshape(-1, vocab)
    if rows2d.stride(-1) != 1:
        rows2d = rows2d.contiguous()
    rows = rows2d.shape[0]
    out = torch.empty(rows, vocab, dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out.reshape(*lead, vocab)
    chunks = triton.cdiv(vocab, CHUNK)
    tops = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    sums = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    grid = (rows, chunks)
    _chunk_stats_kernel[grid](rows2d, tops, sums, vocab, rows2d.stride(0), CHUNKS=chunks, BLOCK=CHUNK)
    _normalize_kernel[grid](
        rows2d,
        tops,
        sums,
        out,
        vocab,
        rows2d.stride(0),
        CHUNKS=chunks,
        CHUNKS_POW2=triton.next_power_of_2(chunks),
        BLOCK=CHUNK,
    )
    return out.reshape(*lead, vocab)
