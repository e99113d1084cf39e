"""gemv / gemv_silu_mul (Triton; the CPU interpreter in CI) vs the float32 references: rows 1 and 2, K and N
not multiples of the tiles, operands read through their strides out of NaN-poisoned buffers (a read past a row
returns NaN and spoils the result), bias or none."""

import pytest
import torch

pytest.importorskip("triton")

from longspec.kernels.gemv import gemv, gemv_naive, gemv_silu_mul, gemv_silu_mul_naive  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Max-abs error relative to the reference's max-abs: both sum in float32 and round once, in another order
# (16-bit: a last-bit difference; the interpreter converts to bf16 by truncation).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
CONFIG = {
    "BLOCK_N": 16,
    "BLOCK_K": 128,
}  # K = 300: two full tiles and a masked third; N = 70: a partial block


def _poisoned_view(rows, cols, pad, dtype, gen, scale=1.0):
    """A [rows, cols] view of a wider NaN-filled buffer (row stride cols + pad) holding random values."""
    wide = torch.full((rows, cols + pad), float("nan"), dtype=dtype)
    wide[:, :cols] = (torch.randn(rows, cols, generator=gen) * scale).to(dtype)
    return wide.to(DEVICE)[:, :cols]


def _close(out, ref, dtype, roundings=1):
    """`roundings`: the 16-bit roundings in a row (each may differ in the last bit), 3 for the fused MLP."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "unwritten or poisoned outputs"
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)
    assert err <= roundings * TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_the_float32_product(dtype, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x = _poisoned_view(rows, 300, 20, dtype, gen)
    weight = _poisoned_view(70, 300, 36, dtype, gen, scale=300**-0.5)
    bias = torch.randn(70, generator=gen).to(DEVICE, dtype) if with_bias else None
    _close(gemv(x, weight, bias, config=CONFIG), gemv_naive(x, weight, bias), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_silu_mul_matches_the_mlp_arithmetic(dtype, rows, with_bias):
    gen = torch.Generator().manual_seed(10 + rows)
    x = _poisoned_view(rows, 300, 20, dtype, gen)
    gate_up = _poisoned_view(140, 300, 36, dtype, gen, scale=3 * 300**-0.5)  # F = 70
    bias = torch.randn(140, generator=gen).to(DEVICE, dtype) if with_bias else None
    got = gemv_silu_mul(x, gate_up, bias, config=CONFIG)
    _close(got, gemv_silu_mul_naive(x, gate_up, bias), dtype, roundings=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
def test_gemv_adds_a_residual_to_the_rounded_projection(dtype, rows):
    # The drafter's last step, h + down(x): the residual read through its row stride (a poisoned wider buffer).
    # The epilogue's add is exactly a caller's add of the kernel's own projection (in bf16 on CUDA only: the
    # interpreter rounds to bf16 by truncation, torch's add to nearest).
    gen = torch.Generator().manual_seed(20 + rows)
    x = _poisoned_view(rows, 300, 20, dtype, gen)
    weight = _poisoned_view(70, 300, 36, dtype, gen, scale=300**-0.5)
    residual = _poisoned_view(rows, 70, 9, dtype, gen, scale=4.0)
    got = gemv(x, weight, residual=residual, config=CONFIG)
    want = gemv_naive(x, weight, residual=residual)
    _close(got, want, dtype, roundings=2)
    if dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(got, residual + gemv(x, weight, config=CONFIG))


def test_default_config_leading_dims_and_too_many_rows():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, 576, generator=gen).to(DEVICE)  # K past one 512-wide tile
    weight = torch.randn(40, 576, generator=gen).to(DEVICE)
    got = gemv(x, weight)
    assert got.shape == (2, 1, 40)
    torch.testing.assert_close(got, x @ weight.T, rtol=1e-5, atol=1e-4)
    assert gemv(x[:0], weight).shape == (0, 1, 40)
    with pytest.raises(ValueError, match="at most 2 rows"):
        gemv(torch.randn(3, 576, device=DEVICE), weight)
