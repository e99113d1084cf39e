"""`naive.gemv_naive` / `naive.gemv_silu_mul_naive` in one launch: program n streams weight rows [BLOCK_N, K]
once (and, fused, the matching up rows F + n) and multiplies them with every row of x (M <= MAX_ROWS).

Shape legend: M rows, K input width, N output width (F for the fused gate/up: the weight has 2F rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longspec.kernels.gemv.rows import MAX_ROWS, as_rows

__all__ = ["default_config", "gemv", "gemv_silu_mul"]


@triton.jit
def _epilogue(
    acc, up, B, R, n, n_ok, F,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr, dtype: tl.constexpr,
):  # fmt: skip
    # The projection rounded to the model's dtype (bias added to the float32 sum first, as a GEMM's epilogue),
    # then, fused, F.silu rounded and the product rounded: HF's MLP arithmetic; or the residual added to the
    # rounded projection and rounded again, as a separate add would.
    if HAS_BIAS:
        acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)
    y = acc.to(dtype)
    if SILU_MUL:
        if HAS_BIAS:
            up += tl.load(B + F + n, mask=n_ok, other=0.0).to(tl.float32)
        g = y.to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
        y = (act * up.to(dtype).to(tl.float32)).to(dtype)
    if HAS_RESIDUAL:
        y = (y.to(tl.float32) + tl.load(R + n, mask=n_ok, other=0.0).to(tl.float32)).to(dtype)
    return y


@triton.jit
def _gemv_kernel(
    X, W, B, R, Y,
    N, K, stride_xm, stride_wn, stride_rm, stride_ym,
    TWO_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # CUDA-core products, summed along K in registers, one [BLOCK_N] accumulator per row (and per half, fused).
    # (Not a tl.dot on a 16-row block, M padded, nor a [rows, BLOCK_N, BLOCK_K] broadcast: at one or two rows
    # both are slower than these per-row accumulators; see the benchmarks.)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    up0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    up1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Row offsets in 64 bits, once per program: as int32 products they would wrap past 2^31 elements (a wide
    # vocabulary's head; a frontier-size model's packed gate/up comes within 20% of it).
    w_rows = W + n.to(tl.int64)[:, None] * stride_wn
    u_rows = w_rows + N * stride_wn.to(tl.int64)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        tile_ok = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + kk[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        x0 = tl.load(X + kk, mask=k_ok, other=0.0).to(tl.float32)
        acc0 += tl.sum(w * x0[None, :], axis=1)
        if TWO_ROWS:
            x1 = tl.load(X + stride_xm + kk, mask=k_ok, other=0.0).to(tl.float32)
            acc1 += tl.sum(w * x1[None, :], axis=1)
        if SILU_MUL:
            u = tl.load(u_rows + kk[None, :], mask=tile_ok, other=0.0).to(tl.float32)
            up0 += tl.sum(u * x0[None, :], axis=1)
            if TWO_ROWS:
                up1 += tl.sum(u * x1[None, :], axis=1)
    dtype = Y.dtype.element_ty
    y0 = _epilogue(acc0, up0, B, R, n, n_ok, N, HAS_BIAS, SILU_MUL, HAS_RESIDUAL, dtype)
    tl.store(Y + n, y0, mask=n_ok)
    if TWO_ROWS:
        y1 = _epilogue(acc1, up1, B, R + stride_rm, n, n_ok, N, HAS_BIAS, SILU_MUL, HAS_RESIDUAL, dtype)
        tl.store(Y + stride_ym + n, y1, mask=n_ok)


def default_config(k: int, silu_mul: bool = False, rows: int = 1) -> dict[str, int]:
    """BLOCK_N, BLOCK_K, num_warps for K = k: narrow row blocks (many programs, each streaming whole rows) and
    wide K tiles; the fused gate/up streams two tiles per step, in narrower K tiles over more warps at one row;
    two rows hold twice the products per tile: 4 warps, and narrower tiles over a narrow K. Chosen as the fastest
    of `benchmarks/projection_routes.py --sweep`'s grid at the 8B and SmolLM2 shapes (two rows: at SmolLM2's,
    where the target runs them)."""
    if rows == 2:  # narrow K in 256-wide tiles (SmolLM2's 576: 3 tiles, not 2 mostly masked), wide K in 512
        return dict(BLOCK_N=4, BLOCK_K=min(256 if k < 1024 else 512, triton.next_power_of_2(k)), num_warps=4,
                    num_stages=4)  # fmt: skip
    if silu_mul:
        return dict(BLOCK_N=8, BLOCK_K=min(256, triton.next_power_of_2(k)), num_warps=8, num_stages=4)
    return dict(BLOCK_N=4, BLOCK_K=min(512, triton.next_power_of_2(k)), num_warps=4, num_stages=4)


def _launch(x, weight, bias, n_out, silu_mul, config, residual=None):
    K = x.shape[-1]
    assert weight.shape[1] == K and weight.stride(-1) == 1 and weight.dtype == x.dtype
    assert bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous())
    rows = as_rows(x)
    M = rows.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {M}")
    out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == out.shape and residual.dtype == x.dtype
        residual = as_rows(residual)
    cfg = default_config(K, silu_mul, M)
    cfg.update(config or {})
    block_n = cfg.pop("BLOCK_N")
    if M:
        _gemv_kernel[(triton.cdiv(n_out, block_n),)](
            rows, weight, bias if bias is not None else weight, residual if residual is not None else out, out,
            n_out, K, rows.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, n_out,
            TWO_ROWS=M == 2, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, HAS_RESIDUAL=residual is not None,
            BLOCK_N=block_n, **cfg,
        )  # fmt: skip
    return out


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype; with
    `residual` [..., N], residual + that (the projection rounded first, as a separate add sees it). config:
    overrides of `default_config` (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    return _launch(x, weight, bias, weight.shape[0], False, config, residual)


def gemv_silu_mul(
    x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor | None = None, *, config: dict | None = None
) -> torch.Tensor:
    """SiLU(x @ gate^T) * (x @ up^T) -> [..., F] for the packed gate_up [2F, K] (gate rows, then up rows; bias
    [2F]): the MLP's first half in one launch, its [..., 2F] intermediate never written."""
    assert gate_up.shape[0] % 2 == 0
    return _launch(x, gate_up, bias, gate_up.shape[0] // 2, True, config)
