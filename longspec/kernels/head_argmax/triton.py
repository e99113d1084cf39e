"""`naive.head_argmax_naive` in one launch for one or two rows of x.

Each program multiplies BLOCK_N head rows with x (CUDA-core products summed along K in float32, as
`kernels.gemv`), rounds them to the model's dtype as the logits would be, and writes its rows' (max, first index)
as a partial; then it counts itself done on a counter. The program that finds itself last merges every partial
(programs cover the head's rows in order, so the first partial holding the maximum holds its first index), maps
the index through the id map and resets the counter for the next launch, which is what makes the one launch
replayable in a CUDA graph: no buffer is cleared before it. The partials are published before the count (a
barrier, then the count's release) and read past the L1 cache after it (acquire), the usual last-block
reduction's ordering. NaN is larger than everything and ties keep the first index, as torch.argmax.

Shape legend: M rows (1 or 2), K input width, N head rows (the vocabulary), P programs (cdiv(N, BLOCK_N)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longspec.kernels.gemv.rows import as_rows
from longspec.kernels.row_argmax.triton import first_max

__all__ = ["default_config", "head_argmax_triton"]

_BIG = tl.constexpr(2147483647)  # no index yet


@triton.jit
def _logits(acc, B, n, n_ok, HAS_BIAS: tl.constexpr, dtype: tl.constexpr):
    """The float32 sums as the logits are written (bias added first, then rounded to the model's dtype), compared
    in float32."""
    if HAS_BIAS:
        acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)
    return acc.to(dtype).to(tl.float32)


@triton.jit
def _merge_row(VALUES, INDEX, IDS, OUT, num_parts, HAS_IDS: tl.constexpr, BLOCK_P: tl.constexpr):
    """One row's partials [P] -> its pick, in index order: a later chunk replaces the running pick only when it
    is larger (or the first NaN), so ties keep the first index."""
    top = tl.max(tl.full([1], float("-inf"), tl.float32), axis=0)  # scalars, as the chunks' results
    first = tl.max(tl.full([1], _BIG, tl.int32), axis=0)
    for p0 in range(0, num_parts, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ok = p < num_parts
        values = tl.load(VALUES + p, mask=ok, other=float("-inf"), cache_modifier=".cg")
        index = tl.load(INDEX + p, mask=ok, other=_BIG, cache_modifier=".cg")
        chunk_top, chunk_first = first_max(values, index, ok, _BIG)
        chunk_nan = chunk_top != chunk_top
        top_nan = top != top
        take = (first == _BIG) | (chunk_nan & ~top_nan) | (~top_nan & (chunk_top > top))
        top = tl.where(take, chunk_top, top)
        first = tl.where(take, chunk_first, first)
    pick = first.to(tl.int64)
    if HAS_IDS:
        pick = tl.load(IDS + pick)
    tl.store(OUT, pick)


@triton.jit(do_not_specialize=["N"])
def _head_argmax_kernel(
    X, W, B, IDS, VALUES, INDEX, COUNTER, OUT,
    N, K, stride_xm, stride_wn,
    TWO_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_IDS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_parts = tl.num_programs(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    w_rows = W + n.to(tl.int64)[:, None] * stride_wn  # 64-bit: a wide vocabulary's head passes 2^31 elements
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x0 = tl.load(X + kk, mask=k_ok, other=0.0).to(tl.float32)
        acc0 += tl.sum(w * x0[None, :], axis=1)
        if TWO_ROWS:
            x1 = tl.load(X + stride_xm + kk, mask=k_ok, other=0.0).to(tl.float32)
            acc1 += tl.sum(w * x1[None, :], axis=1)
    dtype = X.dtype.element_ty
    top, first = first_max(_logits(acc0, B, n, n_ok, HAS_BIAS, dtype), n, n_ok, _BIG)
    tl.store(VALUES + pid, top)
    tl.store(INDEX + pid, first)
    if TWO_ROWS:
        top, first = first_max(_logits(acc1, B, n, n_ok, HAS_BIAS, dtype), n, n_ok, _BIG)
        tl.store(VALUES + num_parts + pid, top)
        tl.store(INDEX + num_parts + pid, first)
    tl.debug_barrier()  # every thread's partial is written before the count publishes it
    done = tl.atomic_add(COUNTER, 1, sem="acq_rel", scope="gpu")
    if done == num_parts - 1:  # the last program: every partial is in
        _merge_row(VALUES, INDEX, IDS, OUT, num_parts, HAS_IDS, BLOCK_P)
        if TWO_ROWS:
            _merge_row(VALUES + num_parts, INDEX + num_parts, IDS, OUT + 1, num_parts, HAS_IDS, BLOCK_P)
        tl.atomic_xchg(COUNTER, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def default_config(k: int) -> dict[str, int]:
    """BLOCK_N, BLOCK_K, num_warps, num_stages for a head of input width k: 32 head rows per program (a thousand
    partials to merge at 32K ids) in 128-wide K tiles over 8 warps, the best or near it of
    `benchmarks/projection_routes.py --sweep` at the SmolLM2, Qwen2.5-Coder-0.5B and 8B heads; BLOCK_P, the
    partials the last program merges per load."""
    return dict(
        BLOCK_N=32, BLOCK_K=min(128, triton.next_power_of_2(k)), num_warps=8, num_stages=4, BLOCK_P=1024
    )


# One counter per device, made at its first launch (a CUDA graph's warm-up runs eagerly before its capture) and
# left at 0 by every launch. Launches on one device must not overlap: the engine runs its steps on one stream.
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def head_argmax_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """x [..., K] (one or two rows in all) with weight [N, K] (bias [N], ids [N] long) -> [...] int64, in one
    launch. config: overrides of `default_config` (BLOCK_N, BLOCK_K, num_warps, num_stages, BLOCK_P)."""
    *lead, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and weight.stride(-1) == 1 and weight.dtype == x.dtype
    assert bias is None or (bias.shape == (N,) and bias.is_contiguous())
    assert ids is None or (ids.shape == (N,) and ids.dtype == torch.long and ids.is_contiguous())
    if N == 0:
        raise ValueError("head_argmax over an empty head")
    rows = as_rows(x)
    M = rows.shape[0]
    if M > 2:
        raise ValueError(f"head_argmax takes at most 2 rows, got {M}")
    out = torch.empty(M, dtype=torch.long, device=x.device)
    if M == 0:
        return out.reshape(lead)
    cfg = default_config(K)
    cfg.update(config or {})
    block_n = cfg.pop("BLOCK_N")
    parts = triton.cdiv(N, block_n)
    values = torch.empty(M, parts, dtype=torch.float32, device=x.device)
    index = torch.empty(M, parts, dtype=torch.int32, device=x.device)
    _head_argmax_kernel[(parts,)](
        rows, weight, bias if bias is not None else weight, ids if ids is not None else out,
        values, index, _counter(x.device), out,
        N, K, rows.stride(0), weight.stride(0),
        TWO_ROWS=M == 2, HAS_BIAS=bias is not None, HAS_IDS=ids is not None,
        BLOCK_N=block_n, **cfg,
    )  # fmt: skip
    return out.reshape(lead)
