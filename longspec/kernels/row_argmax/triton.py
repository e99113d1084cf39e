"""`naive.row_argmax_naive` in two launches over the whole device.

`torch.argmax` reduces a row in one thread block, so a few vocabulary-wide rows leave the GPU almost idle (a
row's time is far above what its bytes need). Here each row is cut into CHUNK-wide pieces:
1. one program per (row, chunk) writes its piece's maximum and the first index that holds it;
2. one program per row takes the first chunk holding the largest of those maxima, and that chunk's index (or,
   with an id map, that index's id).
Chunks are in column order and each keeps its first index, so the result is the row's first maximum, as
torch.argmax. NaN is larger than everything (torch's rule): a chunk holding one reports its first NaN, and a
row its first such chunk. Values are compared in float32 (exact for bf16 / fp16 / fp32 input) or float64.

Shape legend: R rows (the leading dims flattened), V vocabulary, C chunks per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["first_max", "row_argmax_triton"]

CHUNK = 2048


@triton.jit
def first_max(values, index, ok, BIG: tl.constexpr):
    """(max, first index of it) of `values` at `index` (lanes with ok False ignored), NaN the largest."""
    nan = (values != values) & ok
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    clean = tl.where(ok & ~nan, values, float("-inf"))
    top = tl.max(clean, axis=0)
    hit = tl.where(has_nan, nan, ok & (clean == top))
    first = tl.min(tl.where(hit, index, BIG), axis=0)
    return tl.where(has_nan, float("nan"), top), first


@triton.jit
def _chunk_max_kernel(X, VALUES, INDEX, V, stride_x, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    x = tl.load(X + r * stride_x + cols, mask=ok, other=float("-inf"))
    if x.dtype != tl.float64:
        x = x.to(tl.float32)
    top, first = first_max(x, cols, ok, 2147483647)
    tl.store(VALUES + r * CHUNKS + c, top)
    tl.store(INDEX + r * CHUNKS + c, first)


@triton.jit
def _row_pick_kernel(
    VALUES, INDEX, IDS, OUT, CHUNKS: tl.constexpr, CHUNKS_POW2: tl.constexpr, HAS_IDS: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_POW2)
    ok = chunks < CHUNKS
    top = tl.load(VALUES + r * CHUNKS + chunks, mask=ok, other=float("-inf"))
    _, best = first_max(top, chunks, ok, CHUNKS_POW2)
    index = tl.load(INDEX + r * CHUNKS + best).to(tl.int64)
    if HAS_IDS:
        index = tl.load(IDS + index)
    tl.store(OUT + r, index)


def row_argmax_triton(x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """argmax over the last dim of x [..., V] -> [...] int64 (with ids [V] long, contiguous: ids[argmax]), in two
    launches. A 2-d x is read through its row stride (no copy of a [R, V] view); the last dim must be contiguous,
    else it is copied."""
    *lead, vocab = x.shape
    if vocab == 0:
        raise ValueError("row_argmax of an empty last dim")
    rows2d = x if x.dim() == 2 else x.reshape(-1, vocab)
    if rows2d.stride(-1) != 1:
        rows2d = rows2d.contiguous()
    rows = rows2d.shape[0]
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    if rows == 0:
        return out.reshape(lead)
    chunks = triton.cdiv(vocab, CHUNK)
    value_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    values = torch.empty(rows, chunks, dtype=value_dtype, device=x.device)
    index = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(rows, chunks)](
        rows2d, values, index, vocab, rows2d.stride(0), CHUNKS=chunks, BLOCK=CHUNK
    )
    if ids is not None:
        assert ids.shape == (vocab,) and ids.dtype == torch.long and ids.is_contiguous()
    _row_pick_kernel[(rows,)](
        values, index, out if ids is None else ids, out,
        CHUNKS=chunks, CHUNKS_POW2=triton.next_power_of_2(chunks), HAS_IDS=ids is not None,
    )  # fmt: skip
    return out.reshape(lead)
