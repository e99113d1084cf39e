"""layer_ops (Triton; the CPU interpreter in CI) vs the plain-PyTorch references with the HF arithmetic, into
NaN-poisoned output buffers (an element the kernel never writes stays NaN)."""

import pytest
import torch

pytest.importorskip("triton")

from longspec.kernels.layer_ops import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_naive,
    embed_rms_norm,
    embed_rms_norm_naive,
    qkv_rope,
    qkv_rope_naive,
    silu_mul,
    silu_mul_naive,
)
from longspec.modules.rope import RotaryEmbedding  # noqa: E402
from longspec.testing import tiny_hf_config  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Max-abs error relative to the reference's max-abs. bf16: the kernels round once where eager rounds per op
# (and the CPU interpreter converts to bf16 by truncation), so a last-bit difference is expected.
TOL = {torch.float32: 1e-6, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _close(out, ref, dtype):
    if ref.numel() == 0:  # no k/v heads (a query alone)
        return
    assert not torch.isnan(out).any(), "unwritten (NaN) outputs"
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]:.0e}"


def _nan(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 69, 96), (3, 5, 100)])  # AR step, a tree, N not 2^k
def test_add_rms_norm(dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=DEVICE)
    residual = torch.randn(shape, dtype=dtype, device=DEVICE) * 4
    weight = torch.randn(shape[-1], dtype=dtype, device=DEVICE)
    out = (_nan(*shape, dtype=dtype), _nan(*shape, dtype=dtype))
    y, total = add_rms_norm(x, residual, weight, 1e-5, out=out)
    assert y.data_ptr() == out[0].data_ptr() and total.data_ptr() == out[1].data_ptr()
    ref_y, ref_total = add_rms_norm_naive(x, residual, weight, 1e-5)
    _close(total, ref_total, dtype)
    _close(y, ref_y, dtype)
    if dtype == torch.float32:
        assert torch.equal(total, ref_total)  # an add, exact


def test_rms_norm_without_residual_and_strided_rows():
    # The first layer has no residual yet; a [B, T, N] slice of a wider buffer is read in place.
    wide = torch.randn(2, 7, 130, device=DEVICE)
    x = wide[..., :96]
    weight = torch.randn(96, device=DEVICE)
    y, total = add_rms_norm(x, None, weight, 1e-6)
    assert total is x
    _close(y, add_rms_norm_naive(x, None, weight, 1e-6)[0], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_shape", [(1, 1), (2, 69), (3,)])  # AR step, a tree, 1-d ids
def test_embed_rms_norm(dtype, ids_shape, monkeypatch):
    # A forward's first norm over the gathered embeddings: ids repeated, the table's rows read through its
    # stride (a slice of a wider buffer), both outputs allocated NaN-poisoned.
    from longspec.kernels.layer_ops import triton as kernels

    empty = torch.empty
    monkeypatch.setattr(kernels.torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    table = torch.randn(50, 130, dtype=dtype, device=DEVICE)[:, :100] * 3
    weight = torch.randn(100, dtype=dtype, device=DEVICE)
    ids = torch.randint(0, 50, ids_shape, device=DEVICE)
    ids.view(-1)[0] = ids.view(-1)[-1]
    y, h = embed_rms_norm(ids, table, weight, 1e-5)
    ref_y, ref_h = embed_rms_norm_naive(ids, table, weight, 1e-5)
    assert y.shape == h.shape == (*ids_shape, 100)
    assert torch.equal(h, ref_h)  # a gather, exact
    _close(y, ref_y, dtype)


def _rope_inputs(B, T, H, Hkv, D, dtype, shared_positions):
    config = tiny_hf_config(
        "llama3", hidden_size=H * D, head_dim=D, num_attention_heads=H, num_key_value_heads=Hkv
    )  # llama3 rope scaling: angles that are not a plain geometric series
    rotary = RotaryEmbedding.from_config(config).to(DEVICE)
    positions = torch.arange(T, device=DEVICE) + 1000
    positions = (
        positions.expand(B, T)
        if shared_positions
        else positions + 77 * torch.arange(B, device=DEVICE)[:, None]
    )
    cos, sin = rotary.cos_sin(positions, dtype=dtype)
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, dtype=dtype, device=DEVICE)
    return qkv, cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "B, T, H, Hkv, D, qk_norm",
    [
        (1, 1, 9, 3, 64, False),  # SmolLM2's AR step
        (2, 69, 8, 2, 32, False),  # a 69-node tree per row, GQA 4
        (1, 5, 4, 4, 24, True),  # Qwen3's q/k norm; a head dim whose half is not a power of 2
        (2, 16, 9, 0, 64, False),  # q alone: the drafter's cross-attention query (no k/v heads)
        (1, 4, 4, 0, 16, True),  # q alone, with its per-head norm
    ],
)
def test_qkv_rope(dtype, B, T, H, Hkv, D, qk_norm):
    qkv, cos, sin = _rope_inputs(B, T, H, Hkv, D, dtype, shared_positions=B == 1)
    norms = {}
    if qk_norm:
        norms = {
            "q_norm": torch.randn(D, dtype=dtype, device=DEVICE),
            "k_norm": torch.randn(D, dtype=dtype, device=DEVICE),
        }
    out = (_nan(B, H, T, D, dtype=dtype), _nan(B, Hkv, T, D, dtype=dtype), _nan(B, Hkv, T, D, dtype=dtype))
    got = qkv_rope(qkv, cos, sin, H, Hkv, eps=1e-6, out=out, **norms)
    ref = qkv_rope_naive(qkv, cos, sin, H, Hkv, eps=1e-6, **norms)
    for name, g, r in zip("qkv", got, ref, strict=True):
        assert g.shape == r.shape, name
        _close(g, r, dtype)
    assert torch.equal(got[2], ref[2])  # v is copied, not computed


def test_qkv_rope_broadcast_angles():
    # cos/sin shared by the batch (batch stride 0), as a forward over rows of one length passes them.
    qkv, cos, sin = _rope_inputs(3, 4, 4, 2, 16, torch.float32, shared_positions=True)
    cos1, sin1 = cos[:1].expand(3, -1, -1), sin[:1].expand(3, -1, -1)
    got = qkv_rope(qkv, cos1, sin1, 4, 2)
    for g, r in zip(got, qkv_rope_naive(qkv, cos, sin, 4, 2), strict=True):
        _close(g, r, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (2, 69, 2 * 40), (1, 3, 2 * 3000)])
def test_silu_mul(dtype, shape):
    gate_up = torch.randn(shape, dtype=dtype, device=DEVICE) * 3
    out = _nan(*shape[:-1], shape[-1] // 2, dtype=dtype)
    got = silu_mul(gate_up, out=out)
    assert got.data_ptr() == out.data_ptr()
    _close(got, silu_mul_naive(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_rope_writes_the_cache_slots(dtype):
    # Ragged rows: each row's new K/V go to its own pending slots; every other slot is left as it was.
    B, T, H, Hkv, D, Tmax = 2, 5, 4, 2, 16, 32
    qkv, cos, sin = _rope_inputs(B, T, H, Hkv, D, dtype, shared_positions=False)
    slots = torch.tensor([[3, 4, 5, 6, 7], [20, 21, 22, 23, 24]], device=DEVICE)
    k_cache = torch.randn(B, Hkv, Tmax, D, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(B, Hkv, Tmax, D, dtype=dtype, device=DEVICE)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    q, k, v = qkv_rope(qkv, cos, sin, H, Hkv, cache=(k_cache, v_cache, slots))
    ref = qkv_rope_naive(qkv, cos, sin, H, Hkv, cache=(ref_k_cache, ref_v_cache, slots))
    for got, want in zip((q, k, v, k_cache, v_cache), (*ref, ref_k_cache, ref_v_cache), strict=True):
        _close(got, want, dtype)
    untouched = torch.ones(B, Tmax, dtype=torch.bool, device=DEVICE).scatter_(1, slots, False)
    assert torch.equal(k_cache.transpose(1, 2)[untouched], ref_k_cache.transpose(1, 2)[untouched])
    assert torch.equal(v_cache[:, :, 20:25][1], v[1])  # v is copied, not computed


@pytest.mark.parametrize(
    "dtype, cache_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)]
)
def test_qkv_rope_skips_negative_cache_slots(dtype, cache_dtype):
    # A negative slot writes nothing (a ring fill's padding): every slot no token writes keeps its bytes, the
    # others get their token's K/V (rounded to the cache's dtype), whatever they held (NaN here). Row 0 skips a
    # token before and one after the token writing slot 0 (neither may write back what slot 0 held), row 1
    # writes nothing, row 2 every token.
    B, T, H, Hkv, D, Tmax = 3, 5, 4, 2, 16, 8
    qkv, cos, sin = _rope_inputs(B, T, H, Hkv, D, dtype, shared_positions=False)
    slots = torch.tensor([[-1, 6, 0, -1, 7], [-1] * 5, [3, 4, 5, 1, 2]], device=DEVICE)
    written = (slots >= 0).nonzero().tolist()  # (row, token)
    k_cache = torch.randn(B, Hkv, Tmax, D, dtype=cache_dtype, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    for row, token in written:
        k_cache[row, :, slots[row, token]] = v_cache[row, :, slots[row, token]] = float("nan")
    before = k_cache.clone(), v_cache.clone()
    ref_caches = k_cache.clone(), v_cache.clone()
    out = (_nan(B, H, T, D, dtype=dtype), _nan(B, Hkv, T, D, dtype=dtype), _nan(B, Hkv, T, D, dtype=dtype))
    got = qkv_rope(qkv, cos, sin, H, Hkv, out=out, cache=(k_cache, v_cache, slots), skip_negative=True)
    ref = qkv_rope_naive(qkv, cos, sin, H, Hkv, cache=(*ref_caches, slots), skip_negative=True)
    for g, r in zip(got, ref, strict=True):
        _close(g, r, dtype)
    for caches, (_, k, v) in zip(((k_cache, v_cache), ref_caches), (got, ref), strict=True):
        want_k, want_v = (t.clone() for t in before)  # the per-token write of each one's own K/V
        for row, token in written:
            want_k[row, :, slots[row, token]] = k[row, :, token]
            want_v[row, :, slots[row, token]] = v[row, :, token]
        assert torch.equal(caches[0], want_k) and torch.equal(caches[1], want_v)
