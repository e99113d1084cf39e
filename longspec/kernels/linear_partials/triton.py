"""`naive.linear_partials_naive` in one launch: program (n block, split) streams weight rows [BLOCK_N, K / S]
once and multiplies them with every row of x (M <= MAX_ROWS), writing float32 partials.

Shape legend: M rows, K input width, N output width, S splits of K.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from longspec.kernels.linear_partials import MAX_ROWS
from longspec.kernels.linear_partials.naive import SplitK

__all__ = ["default_config", "linear_partials"]


@triton.jit
def _linear_partials_kernel(
    X, W, P, N, K,
    stride_xm, stride_wn, stride_ps, stride_pm,
    SPLIT_LEN: tl.constexpr, TWO_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # SPLIT_LEN is a compile-time multiple of BLOCK_K so that every tile's start is known aligned and the weight
    # streams in wide vector loads (passed at run time, not specialised on, one row read at 40% of this speed).
    # CUDA-core products of each row with the weight tile, summed along K in registers, one [BLOCK_N] accumulator
    # per row. (A tl.dot on a 16-row block, M padded, ran at half the speed at one row on an H200, and a
    # [rows, BLOCK_N, BLOCK_K] broadcast at a third: benchmarks/projection_routes.py.)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(1)
    n_ok = n < N
    start = s * SPLIT_LEN
    stop = tl.minimum(start + SPLIT_LEN, K)
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(start, stop, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < stop
        w = tl.load(W + n[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        w = w.to(tl.float32)
        x0 = tl.load(X + kk, mask=k_ok, other=0.0).to(tl.float32)
        acc0 += tl.sum(w * x0[None, :], axis=1)
        if TWO_ROWS:
            x1 = tl.load(X + stride_xm + kk, mask=k_ok, other=0.0).to(tl.float32)
            acc1 += tl.sum(w * x1[None, :], axis=1)
    tl.store(P + s * stride_ps + n, acc0, mask=n_ok)
    if TWO_ROWS:
        tl.store(P + s * stride_ps + stride_pm + n, acc1, mask=n_ok)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, enough to exercise them
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(n: int, k: int, device: torch.device) -> dict[str, int]:
    """BLOCK_N, BLOCK_K and the split count S: enough programs for ~8 per SM (they only stream the weight), at
    most 8 splits (a split past K is empty: its partials are zeros)."""
    block_n = 16 if n * k > 1 << 26 else 32  # the 8B shape's MLP: more, narrower programs
    block_k = 256 if k >= 2048 else 128
    n_blocks = triton.cdiv(n, block_n)
    splits = max(1, min(8, triton.cdiv(8 * _num_sms(device), n_blocks)))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, splits=splits, num_warps=4, num_stages=4)


def linear_partials(x: torch.Tensor, weight: torch.Tensor, *, config: dict[str, int] | None = None) -> SplitK:
    """x [..., K] (M <= MAX_ROWS rows) @ weight [N, K]^T as a `SplitK` of S float32 partials [S, M, N]. config:
    overrides of `default_config` (BLOCK_N, BLOCK_K, splits, num_warps, num_stages)."""
    K = x.shape[-1]
    N = weight.shape[0]
    assert weight.shape == (N, K) and weight.stride(-1) == 1 and weight.dtype == x.dtype
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"linear_partials takes at most {MAX_ROWS} rows, got {M}")
    cfg = default_config(N, K, x.device)
    cfg.update(config or {})
    splits, block_n, block_k = cfg.pop("splits"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    split_len = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    partials = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    if M:
        _linear_partials_kernel[(triton.cdiv(N, block_n), splits)](
            rows, weight, partials, N, K,
            rows.stride(0), weight.stride(0), partials.stride(0), partials.stride(1),
            SPLIT_LEN=split_len, TWO_ROWS=M == 2, BLOCK_N=block_n, BLOCK_K=block_k, **cfg,
        )  # fmt: skip
    return SplitK(partials, torch.Size((*x.shape[:-1], N)), x.dtype)
