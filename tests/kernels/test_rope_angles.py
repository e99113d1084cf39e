"""rope_angles (Triton; the CPU interpreter in CI) vs its PyTorch reference: positions [T] and [B, T] (strided,
expanded), int64 and int32, from 0 to past 131072, attention scaling 1 and not, a partial rope (R not a power of
two), outputs NaN-poisoned beforehand (an element the kernel never writes stays NaN)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from longspec.kernels.rope_angles import rope_angles, rope_angles_naive  # noqa: E402
from longspec.modules import rope  # noqa: E402
from longspec.modules.rope import RotaryEmbedding  # noqa: E402
from longspec.testing import tiny_hf_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from shapes import llama31_8b_config  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 10000.0}
# Every 97th position up to past Llama-3.1's 131072 (the interpreter runs a program at a time), the edges around
# it, and positions past 2^24, where float32 no longer holds every integer (the conversion's rounding shows).
POSITIONS = torch.cat(
    [
        torch.arange(0, 140_000, 97),
        torch.tensor([1, 2, 131_071, 131_072, 131_073, 2**20 + 1, 2**24 + 1, 2**24 + 3, 10**9 + 7]),
    ]
)
# Allowed distance from the reference in units in the last place of the output dtype. On CUDA none: the same
# float32 operations, and the CUDA math library's cosf / sinf on both sides. In Triton's CPU interpreter cos and sin are
# numpy's float32 functions while the reference's are torch's CPU ones (SLEEF): two implementations, each within
# about 1.5 ulps of the true value (against float64 on these angles: numpy 2.4's 1.49, torch's 0.61), so they can
# be 2 ulps apart, and the product with an attention scaling (1.14 / 1.18 here) can stretch 2 into 3. Seen here:
# 1 ulp apart on about a seventh of the elements, 2 after the scaling. Rounded to 16 bits, such a difference (and
# the interpreter's float32 -> bf16 conversion, which truncates where torch rounds to nearest) moves a value by at
# most one 16-bit ulp.
ULPS = {torch.float32: 3, torch.bfloat16: 1, torch.float16: 1}


def _rotary(name: str) -> RotaryEmbedding:
    # llama3-8b: R = 64, llama3 frequency scaling, attention scaling 1; phi4-mini: a partial LongRoPE (R = 6 of the
    # head's 8), attention scaling > 1; yarn: R = 8, attention scaling > 1.
    configs = {
        "llama3-8b": llama31_8b_config,
        "phi4-mini": lambda: tiny_hf_config("phi4-mini"),
        "yarn": lambda: tiny_hf_config("llama", rope_parameters=YARN),
    }
    return RotaryEmbedding.from_config(configs[name]()).to(DEVICE)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in ulps of their (same) float dtype: bit patterns mapped to ordered integers."""
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = {4: torch.int32, 2: torch.int16}[got.element_size()]
    magnitude = (1 << (8 * got.element_size() - 1)) - 1

    def ordered(x):
        i = x.contiguous().view(bits).long()
        return torch.where(i < 0, -(i & magnitude), i)

    return (ordered(got) - ordered(want)).abs()


def _assert_matches(got, want, dtype):
    assert not torch.isnan(got).any(), "unwritten (NaN) outputs"
    tol = 0 if DEVICE == "cuda" else ULPS[dtype]
    worst = int(_ulps(got, want).max()) if got.numel() else 0
    assert worst <= tol, f"{worst} ulps from the reference (allowed {tol})"


def _poisoned(shape, dtype):
    return tuple(torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["llama3-8b", "phi4-mini", "yarn"])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_matches_the_reference(dtype, name, index_dtype):
    rotary = _rotary(name)
    positions = POSITIONS.to(DEVICE, index_dtype)
    shape = (*positions.shape, rotary.rotary_dim)
    cos, sin = rope_angles(
        positions, rotary.inv_freq, rotary.attention_scaling, dtype, out=_poisoned(shape, dtype)
    )
    ref_cos, ref_sin = rope_angles_naive(positions, rotary.inv_freq, rotary.attention_scaling, dtype)
    _assert_matches(cos, ref_cos, dtype)
    _assert_matches(sin, ref_sin, dtype)
    # Exact where cos / sin are: position 0 gives (scaling, 0) (but for the interpreter's truncation to bf16),
    # and the two halves of a row hold the same values.
    if DEVICE == "cuda" or dtype != torch.bfloat16:
        assert torch.equal(cos[0], ref_cos[0]) and torch.equal(sin[0], ref_sin[0])
    R = rotary.inv_freq.numel()
    assert torch.equal(cos[:, :R], cos[:, R:]) and torch.equal(sin[:, :R], sin[:, R:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_positions_through_their_strides(dtype):
    # [B, T] as the forwards pass them: one row expanded over the batch (stride 0), a strided slice, ragged rows.
    rotary = _rotary("llama3-8b")
    row = torch.arange(1000, 1069, device=DEVICE)
    ragged = torch.stack([row, row + 30_000, row * 7])
    for positions in (row.expand(3, -1), ragged[:, ::2], ragged.to(torch.int32)):
        cos, sin = rope_angles(positions, rotary.inv_freq, 1.0, dtype)
        assert (
            cos.shape == sin.shape == (*positions.shape, 128) and cos.is_contiguous() and sin.is_contiguous()
        )
        ref_cos, ref_sin = rope_angles_naive(positions, rotary.inv_freq, 1.0, dtype)
        _assert_matches(cos, ref_cos, dtype)
        _assert_matches(sin, ref_sin, dtype)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's own arithmetic (numpy), CPU only")
@pytest.mark.parametrize("name", ["llama3-8b", "yarn"])
def test_interpreter_takes_the_reference_angles_bit_for_bit(name):
    # The ulp tolerance above covers the cos / sin implementations only: the float32 angles (position conversion,
    # product) and the scaling are the reference's exactly, so numpy's cos / sin of them is the kernel's output.
    rotary = _rotary(name)
    angles = (POSITIONS[:, None].float() * rotary.inv_freq).numpy()
    scale = np.float32(rotary.attention_scaling)
    cos, sin = rope_angles(POSITIONS, rotary.inv_freq, rotary.attention_scaling)
    for got, fn in ((cos, np.cos), (sin, np.sin)):
        half = fn(angles) * scale if rotary.attention_scaling != 1.0 else fn(angles)
        assert torch.equal(got, torch.from_numpy(np.concatenate([half, half], axis=-1)))


def test_empty_and_scalar_positions():
    rotary = _rotary("yarn")
    cos, sin = rope_angles(torch.empty(2, 0, dtype=torch.long, device=DEVICE), rotary.inv_freq)
    assert cos.shape == sin.shape == (2, 0, 16)
    cos, sin = rope_angles(torch.tensor(0, device=DEVICE), rotary.inv_freq, rotary.attention_scaling)
    assert cos.shape == (16,) and torch.equal(cos, torch.full_like(cos, rotary.attention_scaling))


@pytest.mark.parametrize("name", ["phi4-mini", "yarn"])
def test_cos_sin_routes_to_the_kernel(monkeypatch, name):
    # The route with the device test stubbed: cos_sin's longrope choice and 1-D positions go through unchanged.
    rotary = _rotary(name)
    positions = torch.arange(20, 52, device=DEVICE)  # crosses the tiny LongRoPE's original context (32)
    want = rotary.cos_sin(positions, dtype=torch.bfloat16)
    calls = []

    def kernel(*args):
        calls.append(args[1].clone())
        return rope_angles(*args)

    monkeypatch.setattr(rope.layer_ops, "use_triton", lambda x: True)
    monkeypatch.setattr(rope.angles, "rope_angles", kernel, raising=False)
    got = rotary.cos_sin(positions, dtype=torch.bfloat16)
    assert len(calls) == 1
    if name == "phi4-mini":  # the long factors, as the reference forward picked them
        assert torch.equal(calls[0], rotary.long_inv_freq)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (1, 32, rotary.rotary_dim)
        _assert_matches(g, w, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama3-8b", "phi4-mini", "yarn"])
def test_gpu_bit_identical_to_torch(dtype, name):
    # Every position 0..131072 and past it, the large ones of POSITIONS, [B, T] with an expanded row and ragged
    # rows, int64 and int32: torch's own CUDA ops and the kernel, bit for bit.
    rotary = _rotary(name)
    rotary.set_long(False)  # LongRoPE: one fixed set, so `cos_sin` below rotates with the same frequencies
    row = torch.arange(0, 131_072 + 257, device="cuda")
    batched = torch.stack([row[:4096], row[:4096] + 127_000, row[:4096] * 300])
    with torch.inference_mode():
        for positions in (row, POSITIONS.cuda(), row.expand(2, -1), batched, batched.to(torch.int32)):
            got = rope_angles(positions, rotary.inv_freq, rotary.attention_scaling, dtype)
            want = rope_angles_naive(positions, rotary.inv_freq, rotary.attention_scaling, dtype)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            # The route: the kernel on CUDA at inference ([T] positions come back as [1, T, D]).
            via_module = rotary.cos_sin(positions, dtype=dtype)
            assert torch.equal(via_module[0].view_as(want[0]), want[0])
            assert torch.equal(via_module[1].view_as(want[1]), want[1])
