"""linear_partials (Triton; the CPU interpreter in CI) vs the float32 product, and the fused element-wise steps
taking its split-K partials (`SplitK`) vs their references, into NaN-poisoned buffers."""

import pytest
import torch

pytest.importorskip("triton")

from longspec.kernels.layer_ops import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_naive,
    qkv_rope,
    qkv_rope_naive,
    silu_mul,
    silu_mul_naive,
)
from longspec.kernels.linear_partials import SplitK, linear_partials, linear_partials_naive  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _poisoned_view(rows, cols, pad, dtype):
    """A [rows, cols] view of a wider NaN-filled buffer (row stride cols + pad), filled with random values: a
    read past `cols` returns NaN."""
    wide = torch.full((rows, cols + pad), float("nan"), dtype=dtype)
    wide[:, :cols] = torch.randn(rows, cols, dtype=dtype)
    return wide.to(DEVICE)[:, :cols]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("splits", [1, 3, 8])  # K = 300 in tiles of 128: with 8 splits five are empty
def test_partials_sum_to_the_product(dtype, rows, splits):
    x = _poisoned_view(rows, 300, 20, dtype)
    weight = _poisoned_view(70, 300, 36, dtype)  # N not a multiple of BLOCK_N, rows read through their stride
    got = linear_partials(x, weight, config={"splits": splits, "BLOCK_K": 128, "BLOCK_N": 32})
    want = linear_partials_naive(x, weight)
    assert got.partials.shape == (splits, rows, 70) and got.shape == (rows, 70) and got.dtype == dtype
    assert torch.isfinite(got.partials).all()
    total = got.partials.sum(0)
    err = (total - want.partials[0]).abs().max() / want.partials[0].abs().max()
    assert err < 1e-5, err  # float32 accumulation either way, in another order
    if splits == 8:
        assert (got.partials[3:] == 0).all()  # splits past K contribute exact zeros
    assert torch.equal(got.sum(), total.to(dtype))


def test_leading_dims_and_too_many_rows():
    x = torch.randn(2, 1, 64, device=DEVICE)
    weight = torch.randn(40, 64, device=DEVICE)
    got = linear_partials(x, weight)
    assert got.shape == (2, 1, 40)
    torch.testing.assert_close(got.sum(), x @ weight.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="at most 2 rows"):
        linear_partials(torch.randn(3, 64, device=DEVICE), weight)


def _close(out, ref, dtype):
    """Max-abs error relative to the reference's max-abs (bf16: one rounding where the reference rounds per op,
    and the interpreter's bf16 conversion truncates: a last-bit difference)."""
    assert not torch.isnan(out).any(), "unwritten (NaN) outputs"
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)
    assert err <= (2e-2 if dtype == torch.bfloat16 else 1e-6), err


def _split(value: torch.Tensor, parts: int, dtype) -> SplitK:
    """`value` [..., N] (float32) as `parts` random float32 partials that sum to it."""
    noise = torch.randn(parts - 1, *value.shape, device=value.device)
    partials = torch.cat([value[None] - noise.sum(0, keepdim=True), noise]).reshape(
        parts, -1, value.shape[-1]
    )
    return SplitK(partials.contiguous(), value.shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_steps_sum_the_partials(dtype):
    gen = torch.Generator().manual_seed(0)
    # add_rms_norm of a projection's partials, with a residual
    delta = _split(torch.randn(2, 1, 96, generator=gen).to(DEVICE), 3, dtype)
    residual = torch.randn(2, 1, 96, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(96, generator=gen).to(DEVICE, dtype)
    out = tuple(torch.full((2, 1, 96), float("nan"), device=DEVICE, dtype=dtype) for _ in range(2))
    y, total = add_rms_norm(delta, residual, weight, 1e-5, out=out)
    ref_y, ref_total = add_rms_norm_naive(delta, residual, weight, 1e-5)
    _close(total, ref_total, dtype)
    _close(y, ref_y, dtype)
    # silu * up of the packed gate/up partials
    gate_up = _split(torch.randn(3, 2, 200, generator=gen).to(DEVICE) * 3, 4, dtype)
    _close(silu_mul(gate_up), silu_mul_naive(gate_up), dtype)
    # q/k RoPE straight from the packed QKV partials: 4 q heads, 2 kv heads, head dim 16
    H, Hkv, D, B, T = 4, 2, 16, 2, 3
    qkv = _split(torch.randn(B, T, (H + 2 * Hkv) * D, generator=gen).to(DEVICE), 2, dtype)
    angles = torch.randn(B, T, D // 2, generator=gen).to(DEVICE)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    for got, want in zip(qkv_rope(qkv, cos, sin, H, Hkv), qkv_rope_naive(qkv, cos, sin, H, Hkv), strict=True):
        _close(got, want, dtype)
