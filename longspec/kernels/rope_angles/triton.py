"""`naive.rope_angles_naive` in one launch: program i takes BLOCK_M positions, computes their [BLOCK_M, R] angles
once and writes cos and sin to both halves of each row.

Shape legend: M positions (the leading dims flattened, as rows x cols of the position tensor), R rotary half
(inv_freq's length), D = 2R.

The float32 operations are the reference's, in its order: the position converted to float32 (round to nearest,
as `.float()`), one product with inv_freq, cos and sin (on CUDA `tl.cos` / `tl.sin` are libdevice's `__nv_cosf` /
`__nv_sinf`, the CUDA math library's cosf / sinf that torch's kernels call; Triton's libdevice flushes subnormals,
and no angle or intermediate here is one), the product with attention_scaling, one rounding to the output dtype.
So on CUDA the result is expected to be bit-identical to the reference's (the GPU test checks it); Triton's CPU
interpreter takes numpy's cos / sin instead, an ulp or two from torch's CPU ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rope_angles", "rope_cos_sin"]

# Elements of the [BLOCK_M, R] angle tile per program (BLOCK_M = TILE // R rows): a decode step's few positions
# are one program, a long prompt's are spread over the device; fixed, so no position count compiles a variant.
TILE = 2048


@triton.jit
def rope_cos_sin(pos, inv_freq, scaling, SCALED: tl.constexpr):
    """Positions [M] (integers) and inv_freq [R] float32 -> cos, sin [M, R] float32: the reference's operations in
    its order (the position to float32, one product, cos and sin, the attention scaling). Every kernel that
    computes rotary angles calls this one."""
    angle = pos.to(tl.float32)[:, None] * inv_freq[None, :]
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    if SCALED:
        cos = cos * scaling
        sin = sin * scaling
    return cos, sin


@triton.jit(do_not_specialize=["num_positions", "num_cols", "scaling"])
def _rope_angles_kernel(
    POS, INV_FREQ, COS, SIN,
    num_positions, num_cols, stride_row, stride_col, scaling,
    HALF: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < num_positions
    r = tl.arange(0, BLOCK_R)
    r_ok = r < HALF
    # Positions read through their strides: a batch expanded from one row (stride 0) is not copied first.
    pos = tl.load(POS + (m // num_cols) * stride_row + (m % num_cols) * stride_col, mask=m_ok, other=0)
    inv_freq = tl.load(INV_FREQ + r, mask=r_ok, other=0.0)
    cos, sin = rope_cos_sin(pos, inv_freq, scaling, SCALED)
    cos = cos.to(COS.dtype.element_ty)
    sin = sin.to(SIN.dtype.element_ty)
    ok = m_ok[:, None] & r_ok[None, :]
    dst = m[:, None] * (2 * HALF) + r[None, :]
    tl.store(COS + dst, cos, mask=ok)
    tl.store(COS + dst + HALF, cos, mask=ok)
    tl.store(SIN + dst, sin, mask=ok)
    tl.store(SIN + dst + HALF, sin, mask=ok)


def rope_angles(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] int32 / int64 (any strides), inv_freq [R] float32 -> (cos, sin) [..., D] in `dtype`, one
    launch. Both are views of one [2, ..., D] buffer (each contiguous), or the contiguous buffers `out`."""
    (R,) = inv_freq.shape
    assert inv_freq.dtype == torch.float32 and inv_freq.is_contiguous()
    assert inv_freq.device == positions.device
    shape = (*positions.shape, 2 * R)
    if out is None:
        out = torch.empty((2, *shape), dtype=dtype, device=positions.device).unbind(0)
    cos, sin = out
    assert cos.shape == sin.shape == shape and cos.dtype == sin.dtype == dtype
    assert cos.is_contiguous() and sin.is_contiguous()
    M = positions.numel()
    if M:
        # Positions as [rows, cols]: for the usual [T] and [B, T] (expanded ones too) a view, not a copy.
        rows = positions.reshape(1, M) if positions.dim() < 2 else positions.reshape(-1, positions.shape[-1])
        block_r = triton.next_power_of_2(R)
        block_m = max(1, TILE // block_r)
        _rope_angles_kernel[(triton.cdiv(M, block_m),)](
            rows, inv_freq, cos, sin,
            M, rows.shape[1], rows.stride(0), rows.stride(1), float(attention_scaling),
            HALF=R, SCALED=attention_scaling != 1.0, BLOCK_M=block_m, BLOCK_R=block_r, num_warps=4,
        )  # fmt: skip
    return cos, sin
