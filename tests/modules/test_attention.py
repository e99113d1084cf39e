"""Attention backends vs the math reference; hybrid/merge identities; errors; GPU backends at real shapes."""

import os
import sys
import types

import torch

# Triton picks interpreter vs compiled when a kernel is defined; longspec defines them lazily, on first use.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from longspec.kernels import HAS_TRITON  # noqa: E402
from longspec.modules.attention import (  # noqa: E402
    HAS_FLASH_ATTN,
    attention,
    cache_attention,
    hybrid_attention,
    math_attention,
    merge_attention,
    tree_attention,
)
from longspec.modules.masks import aligned_rows

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
needs_flash_attn = pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn not installed")
log2_warning_ok = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")


def _qkv(B=2, H=4, Hkv=2, Tq=6, Tk=9, D=16, dtype=torch.float32, device="cpu"):
    q = torch.randn(B, H, Tq, D, dtype=dtype, device=device)
    k = torch.randn(B, Hkv, Tk, D, dtype=dtype, device=device)
    v = torch.randn(B, Hkv, Tk, D, dtype=dtype, device=device)
    return q, k, v


def _loop_reference(q, k, v, visible, scale):
    """Attention one (batch, head, query) at a time from a visibility predicate: the definition, no tricks."""
    B, H, Tq, D = q.shape
    group = H // k.shape[1]
    out = torch.zeros(B, H, Tq, D, dtype=torch.float64)
    lse = torch.full((B, H, Tq), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                keys = [j for j in range(k.shape[2]) if visible(i, j)]
                if not keys:
                    continue
                s = torch.stack([q[b, h, i].double() @ k[b, h // group, j].double() * scale for j in keys])
                lse[b, h, i] = torch.logsumexp(s, 0)
                out[b, h, i] = torch.softmax(s, 0) @ v[b, h // group, keys].double()
    return out, lse


def _tree(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return _ancestor_mask([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)])


def _ancestor_mask(parents: list[int]) -> torch.Tensor:
    """Row i: node i and its ancestors (parents precede children)."""
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


# ------------------------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("causal, window", [(True, None), (True, 3), (False, None), (False, 2)])
@pytest.mark.parametrize("Tq, Tk", [(6, 9), (9, 9), (9, 6)])
def test_math_attention_matches_definition(causal, window, Tq, Tk):
    q, k, v = _qkv(B=1, H=4, Hkv=2, Tq=Tq, Tk=Tk)

    def visible(i, j):  # bottom-right alignment: query i sits at key position Tk - Tq + i
        t = Tk - Tq + i
        return (not causal or j <= t) and (window is None or t - j <= window)

    out, lse = attention(q, k, v, causal=causal, window=window, scale=0.3, backend="math")
    ref_out, ref_lse = _loop_reference(q, k, v, visible, 0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    if causal and Tq > Tk:  # the first Tq - Tk queries precede every key
        assert torch.isneginf(lse[..., : Tq - Tk]).all() and (out[..., : Tq - Tk, :] == 0).all()


def test_auto_on_cpu_is_math_and_differentiable():
    q, k, v = (t.requires_grad_() for t in _qkv())
    out, lse = attention(q, k, v, window=4)
    ref_out, ref_lse = attention(q, k, v, window=4, backend="math")
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    out.square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_cache_attention_lengths():
    q, k, v = _qkv(Tk=20)
    n = 13
    ref_out, ref_lse = attention(q, k[:, :, :n], v[:, :, :n], causal=False)
    for cache_len in (n, torch.tensor(n), torch.tensor([n, n])):
        out, lse = cache_attention(q, k, v, cache_len)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse)
    out, lse = cache_attention(q, k, v, torch.tensor([n, 4]))  # per-batch lengths
    torch.testing.assert_close(out[1], attention(q[1:], k[1:, :, :4], v[1:, :, :4], causal=False)[0][0])
    out, lse = cache_attention(q, k, v, 0)  # empty cache
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_cache_attention_causal_tail_is_a_chain_over_the_cache():
    """causal=True: the queries are the last Tq of each row's cache_len slots; == hybrid attention of those Tq new
    tokens under a causal mask beside the cache before them (math), per row, for host and device lengths."""
    for Tq in (4, 1):  # 1: an AR step, whose one query sees every slot
        q, k, v = _qkv(Tq=Tq, Tk=20)
        causal = torch.ones(Tq, Tq, dtype=torch.bool).tril()
        for cache_len in (13, torch.tensor([13, 6])):
            out, lse = cache_attention(q, k, v, cache_len, causal=True)
            for b, n in enumerate(torch.as_tensor(cache_len).expand(2).tolist()):
                rows, new = slice(b, b + 1), slice(n - Tq, n)
                ref_out, ref_lse = hybrid_attention(
                    q[rows],
                    k[rows, :, new],
                    v[rows, :, new],
                    k[rows],
                    v[rows],
                    n - Tq,
                    causal,
                    backend="math",
                )
                torch.testing.assert_close(out[rows], ref_out)
                torch.testing.assert_close(lse[rows], ref_lse)


def _forest(branches, levels):
    """Ancestor mask of a forest of `branches` chains of `levels` nodes from one root, laid out level by level
    (root 0; branch i of level d at 1 + (d - 1) * branches + i), built from its parents."""
    T = 1 + branches * levels
    return _ancestor_mask([-1] + [0 if t <= branches else t - branches for t in range(1, T)])


@pytest.mark.parametrize("branches, levels", [(1, 3), (2, 1), (2, 3), (4, 3)])
def test_cache_attention_causal_forest_is_a_tree_over_the_cache(branches, levels):
    """causal=True, branches: the last Tq slots are a forest laid out level by level; == hybrid attention of those
    Tq tokens under the forest's ancestor mask beside the cache before them (math), host and device lengths."""
    Tq = 1 + branches * levels
    q, k, v = _qkv(Tq=Tq, Tk=20)
    forest = _forest(branches, levels)
    for cache_len in (17, torch.tensor([17, Tq])):  # row 1: the forest alone
        out, lse = cache_attention(q, k, v, cache_len, causal=True, branches=branches, backend="math")
        for b, n in enumerate(torch.as_tensor(cache_len).expand(2).tolist()):
            rows, new = slice(b, b + 1), slice(n - Tq, n)
            ref_out, ref_lse = hybrid_attention(
                q[rows], k[rows, :, new], v[rows, :, new], k[rows], v[rows], n - Tq, forest, backend="math"
            )
            torch.testing.assert_close(out[rows], ref_out)
            torch.testing.assert_close(lse[rows], ref_lse)


def test_cache_attention_forest_errors(stand_in_flash_attn):
    q, k, v = _qkv(Tq=5, Tk=20)
    for branches in (0, 3):  # Tq - 1 = 4 is not a multiple of 3
        with pytest.raises(ValueError, match="branches"):
            cache_attention(q, k, v, 13, causal=True, branches=branches)
    with pytest.raises(ValueError, match="cannot run this call.*forest"):
        cache_attention(q, k, v, 13, causal=True, branches=2, backend="flash_attn")
    # "auto" would pick flash_attn (the stand-in) for a chain here, but not for a forest (on the CPU: torch_flash).
    out, lse = cache_attention(q, k, v, 13, causal=True, branches=2)
    ref_out, ref_lse = cache_attention(q, k, v, 13, causal=True, branches=2, backend="math")
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    chain = cache_attention(q, k, v, 13, causal=True)
    assert not torch.allclose(chain[1], ref_lse)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_torch_flash_attention_matches_math(group, dtype):
    """attention()'s CPU flash path (inference: a prefill's first chunk) == math, causal (square) or not, with GQA;
    "auto" takes it without autograd and keeps math with it."""
    q, k, v = _qkv(B=2, H=2 * group, Hkv=2, Tq=37, Tk=37, D=32, dtype=dtype)
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for causal in (True, False):
        out, lse = attention(q, k, v, causal=causal, backend="torch_flash")
        ref_out, ref_lse = attention(q, k, v, causal=causal, backend="math")
        torch.testing.assert_close(out, ref_out, **tol)
        torch.testing.assert_close(lse, ref_lse, **tol)
        auto = attention(q, k, v, causal=causal)
        assert torch.equal(auto[0], out)
    q32 = q.float().requires_grad_()
    out, _ = attention(q32, k.float(), v.float())  # autograd: the math path, gradients flow
    out.sum().backward()
    assert q32.grad is not None


@pytest.mark.parametrize("Tq, branches", [(1, 1), (2, 1), (9, 1), (9, 4), (5, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_torch_flash_cache_matches_math(Tq, branches, dtype):
    """cache_attention's CPU flash path (torch_flash off CUDA: aten's CPU flash kernel, GQA folded, a causal tail or
    forest as an additive mask) == the math reference, causal or not, with a GQA group of 3; an empty cache is
    out 0, lse -inf; it refuses autograd and per-row lengths; "auto" takes it for host lengths on the CPU."""
    q, k, v = _qkv(B=1, H=6, Hkv=2, Tq=Tq, Tk=40, D=32, dtype=dtype)
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for causal in (True, False):
        kw = dict(causal=causal, branches=branches if causal else 1)
        out, lse = cache_attention(q, k, v, 31, backend="torch_flash", **kw)
        ref_out, ref_lse = cache_attention(q, k, v, 31, backend="math", **kw)
        torch.testing.assert_close(out, ref_out, **tol)
        torch.testing.assert_close(lse, ref_lse, **tol)
        auto = cache_attention(q, k, v, 31, **kw)
        assert torch.equal(auto[0], out) and torch.equal(auto[1], lse)
    out, lse = cache_attention(q, k, v, 0, backend="torch_flash")
    assert (out == 0).all() and torch.isneginf(lse).all()
    with pytest.raises(ValueError, match="per-batch cache lengths"):
        cache_attention(*_qkv(Tq=Tq, Tk=40), torch.tensor([31, 20]), backend="torch_flash")
    with torch.enable_grad(), pytest.raises(ValueError, match="no gradients"):
        cache_attention(q.float().requires_grad_(), k.float(), v.float(), 31, backend="torch_flash")


def test_tree_attention_matches_definition():
    T = 11
    q, k, v = _qkv(B=1, Tq=T, Tk=T)
    mask = _tree(T)
    out, lse = tree_attention(q, k, v, mask, scale=0.25, backend="math")
    ref_out, ref_lse = _loop_reference(q, k, v, lambda i, j: bool(mask[i, j]), 0.25)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_merge_equals_attention_over_concatenation():
    q, k, v = _qkv(Tk=15)
    out_a, lse_a = attention(q, k[:, :, :6], v[:, :, :6], causal=False)
    out_b, lse_b = attention(q, k[:, :, 6:], v[:, :, 6:], causal=False)
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = attention(q, k, v, causal=False)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    # An empty side (lse = -inf) leaves the other unchanged, and two empty sides stay empty (0, -inf).
    empty_out, empty_lse = torch.zeros_like(out_a), torch.full_like(lse_a, float("-inf"))
    out, lse = merge_attention(empty_out, empty_lse, out_a, lse_a)
    torch.testing.assert_close(out, out_a)
    torch.testing.assert_close(lse, lse_a)
    out, lse = merge_attention(empty_out, empty_lse, empty_out, empty_lse)
    assert (out == 0).all() and torch.isneginf(lse).all() and not out.isnan().any()


def _hybrid_reference(q, k_new, v_new, k_cache, v_cache, n, mask):
    """One masked attention over [cache[:n] ++ new]: the cache fully visible, the new tokens by `mask`."""
    keys = torch.cat([k_cache[:, :, :n], k_new], dim=2)
    values = torch.cat([v_cache[:, :, :n], v_new], dim=2)
    full = torch.cat([torch.ones(mask.shape[0], n, dtype=torch.bool), mask], dim=1)
    return math_attention(q, keys, values, full)


@pytest.mark.parametrize("n", [0, 1, 23])
def test_hybrid_equals_one_masked_attention(n):
    T = 9
    q, k_new, v_new = _qkv(Tq=T, Tk=T)
    _, k_cache, v_cache = _qkv(Tk=30)
    mask = _tree(T, seed=n)
    out, lse = hybrid_attention(q, k_new, v_new, k_cache, v_cache, n, mask)
    ref_out, ref_lse = _hybrid_reference(q, k_new, v_new, k_cache, v_cache, n, mask)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def _ragged_hybrid_case(device="cpu"):
    """A ragged batch: per-sequence cache lengths (an empty cache, one slot, full) and one tree per sequence."""
    B, T, Tmax = 3, 9, 30
    q, k_new, v_new = _qkv(B=B, H=8, Hkv=2, Tq=T, Tk=T, device=device)
    _, k_cache, v_cache = _qkv(B=B, H=8, Hkv=2, Tk=Tmax, device=device)
    lengths = torch.tensor([0, 1, Tmax], device=device)
    masks = torch.stack([_tree(T, seed=b) for b in range(B)]).to(device)
    masks[0, 3] = False  # with the empty cache: a query that sees nothing
    return q, k_new, v_new, k_cache, v_cache, lengths, masks


def test_hybrid_ragged_batch_equals_each_sequence_alone():
    # Per-sequence lengths [B] and trees [B, T, T]: row b == a batch of one with its own length and tree.
    q, k_new, v_new, k_cache, v_cache, lengths, masks = _ragged_hybrid_case()
    out, lse = hybrid_attention(q, k_new, v_new, k_cache, v_cache, lengths, masks)
    assert (out[0, :, 3] == 0).all() and torch.isneginf(lse[0, :, 3]).all()
    for b, n in enumerate(lengths.tolist()):
        row = slice(b, b + 1)
        ref_out, ref_lse = _hybrid_reference(q[row], k_new[row], v_new[row], k_cache[row], v_cache[row], n,
                                             masks[b])  # fmt: skip
        torch.testing.assert_close(out[row], ref_out)
        torch.testing.assert_close(lse[row], ref_lse)


# ----------------------------------------------------------------------------------------------- errors


def test_bad_arguments_raise_value_error():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention(q, k, v, backend="fast")
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1))
    with pytest.raises(ValueError, match="torch_flash"):
        attention(q.requires_grad_(), k, v, backend="torch_flash")  # CPU tensors with autograd
    q = q.detach()
    with pytest.raises(ValueError, match="no arbitrary-mask"):
        tree_attention(q, k, v, torch.ones(6, 9, dtype=torch.bool), backend="torch_flash")
    with pytest.raises(ValueError, match="mask must be bool"):
        tree_attention(q, k, v, torch.ones(6, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="cache_len"):
        cache_attention(q, k, v, 10)
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, window=-1)


@pytest.mark.skipif(HAS_FLASH_ATTN, reason="flash-attn installed")
def test_missing_flash_attn_names_the_install():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"pip install 'longspec\[flash\]'"):
        attention(q, k, v, backend="flash_attn")


# ------------------------------------------------- flash-attn adapter vs a stand-in with its documented API


def _documented_flash_attn():
    """A CPU stand-in for flash-attn 2 implementing its documented semantics ([B, T, H, D] layout, GQA,
    bottom-right causal, window_size=(left, right) with -1 = unbounded, softmax_lse [B, H, Tq] with +inf for
    rows that see nothing), so the adapter's transposes and window mapping are checked without the package."""
    from longspec.kernels.fused_mask_attn import fused_mask_attn_naive

    def run(q, k, v, visible, scale):
        out, lse = fused_mask_attn_naive(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), visible, scale
        )
        return out.transpose(1, 2).to(q.dtype), lse.masked_fill(torch.isneginf(lse), float("inf"))

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        return_attn_probs=False, **_):  # fmt: skip
        Tq, Tk = q.shape[1], k.shape[1]
        i = torch.arange(Tq)[:, None] + Tk - Tq
        j = torch.arange(Tk)[None, :]
        left, right = window_size[0], 0 if causal else window_size[1]
        visible = torch.ones(Tq, Tk, dtype=torch.bool)
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
        out, lse = run(q, k, v, visible, softmax_scale)
        return (out, lse, None) if return_attn_probs else out

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None, causal=False,
                                return_softmax_lse=False, **_):  # fmt: skip
        B, Tq, Tmax = q.shape[0], q.shape[1], k_cache.shape[1]
        ends = torch.as_tensor(cache_seqlens).expand(B)[:, None, None]  # [B, 1, 1]
        if causal:  # bottom-right: query i is key seqlen - Tq + i
            ends = ends - Tq + 1 + torch.arange(Tq)[None, :, None]
        visible = torch.arange(Tmax)[None, None, :] < ends  # [B, 1 or Tq, Tmax]
        out, lse = run(q, k_cache, v_cache, visible.expand(B, Tq, Tmax), softmax_scale)
        return (out, lse) if return_softmax_lse else out

    module = types.ModuleType("flash_attn")
    module.flash_attn_func = flash_attn_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


@pytest.fixture
def stand_in_flash_attn(monkeypatch):
    import longspec.modules.attention_backends as backends

    monkeypatch.setitem(sys.modules, "flash_attn", _documented_flash_attn())
    monkeypatch.setattr(backends, "flash_attn_ok", lambda q: True)


@pytest.mark.parametrize("causal, window", [(True, None), (True, 3), (False, None), (False, 2)])
@pytest.mark.parametrize("Tq, Tk", [(7, 7), (4, 9), (9, 5)])
def test_flash_attn_adapter(stand_in_flash_attn, causal, window, Tq, Tk):
    q, k, v = _qkv(Tq=Tq, Tk=Tk)
    out, lse = attention(q, k, v, causal=causal, window=window, backend="flash_attn")
    ref_out, ref_lse = attention(q, k, v, causal=causal, window=window, backend="math")
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)  # includes -inf rows (Tq > Tk, causal)


def test_flash_attn_cache_adapter(stand_in_flash_attn):
    q, k, v = _qkv(Tk=20)
    for cache_len in (13, torch.tensor(13), torch.tensor([13, 0])):
        out, lse = cache_attention(q, k, v, cache_len, backend="flash_attn")
        ref_out, ref_lse = cache_attention(q, k, v, cache_len, backend="math")
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse)
    for cache_len in (13, torch.tensor([13, 9])):
        out, lse = cache_attention(q, k, v, cache_len, causal=True, backend="flash_attn")
        ref_out, ref_lse = cache_attention(q, k, v, cache_len, causal=True, backend="math")
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse)


# ------------------------------------------------------------------------- Triton backend (interpreter)


@needs_triton
@log2_warning_ok
def test_triton_backends_match_math():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    T, n = 13, 70
    q, k_new, v_new = _qkv(B=1, H=8, Hkv=2, Tq=T, Tk=T, device=device)
    _, k_cache, v_cache = _qkv(B=1, H=8, Hkv=2, Tk=96, device=device)
    mask = _tree(T, seed=5).to(device)
    cache_len = torch.tensor(n, device=device)
    pairs = [
        (attention(q, k_new, v_new, backend="triton"), attention(q, k_new, v_new, backend="math")),
        (tree_attention(q, k_new, v_new, mask, backend="triton"), tree_attention(q, k_new, v_new, mask, backend="math")),
        (cache_attention(q, k_cache, v_cache, cache_len, backend="triton"),
         cache_attention(q, k_cache, v_cache, cache_len, backend="math")),
        (cache_attention(q, k_cache, v_cache, cache_len, causal=True, backend="triton"),
         cache_attention(q, k_cache, v_cache, cache_len, causal=True, backend="math")),
        (cache_attention(q, k_cache, v_cache, cache_len, causal=True, branches=4, backend="triton"),
         cache_attention(q, k_cache, v_cache, cache_len, causal=True, branches=4, backend="math")),
        (hybrid_attention(q, k_new, v_new, k_cache, v_cache, cache_len, mask, backend="triton"),
         hybrid_attention(q, k_new, v_new, k_cache, v_cache, cache_len, mask, backend="math")),
    ]  # fmt: skip
    for (out, lse), (ref_out, ref_lse) in pairs:
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@needs_triton
@log2_warning_ok
def test_triton_hybrid_ragged_batch_matches_math():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = _ragged_hybrid_case(device)
    out, lse = hybrid_attention(*case, backend="triton")
    ref_out, ref_lse = hybrid_attention(*case, backend="math")
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@needs_triton
def test_triton_refuses_gradients():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (t.requires_grad_() for t in _qkv(device=device))
    with pytest.raises(ValueError, match="forward only"):
        attention(q, k, v, backend="triton")


# ------------------------------------------------------------------------------------ GPU, real shapes

BF16 = dict(atol=2e-2, rtol=2e-2)


def _real(Tq, Tk, dtype=torch.bfloat16):
    return _qkv(B=1, H=32, Hkv=8, Tq=Tq, Tk=Tk, D=128, dtype=dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 4])
def test_gpu_torch_flash_matches_math(causal, group):
    q, k, v = _qkv(B=2, H=8, Hkv=8 // group, Tq=256, Tk=256, D=128, dtype=torch.bfloat16, device="cuda")
    out, lse = attention(q, k, v, causal=causal, backend="torch_flash")
    ref_out, ref_lse = attention(q, k, v, causal=causal, backend="math")
    torch.testing.assert_close(out, ref_out, **BF16)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
def test_gpu_torch_flash_grads_match_math():
    q, k, v = (t.requires_grad_() for t in _real(128, 128))
    grads = []
    for backend in ("torch_flash", "math"):
        out, _ = attention(q, k, v, causal=True, backend=backend)
        grads.append(torch.autograd.grad(out.float().square().sum(), (q, k, v)))
    for g, ref in zip(*grads, strict=True):
        torch.testing.assert_close(g.float(), ref.float(), atol=5e-2 * ref.abs().max().item(), rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("context", [8192, 32768])
def test_gpu_cache_backends_agree(context):
    q, k_cache, v_cache = _real(74, context + 100)
    ref_out, ref_lse = cache_attention(q, k_cache, v_cache, context, backend="math")
    for backend in ("torch_flash", "triton", "auto") + (("flash_attn",) if HAS_FLASH_ATTN else ()):
        out, lse = cache_attention(q, k_cache, v_cache, context, backend=backend)
        torch.testing.assert_close(out, ref_out, **BF16)
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("context", [8192, 131072])
def test_gpu_hybrid_auto_matches_math(context):
    T = 74
    q, k_new, v_new = _real(T, T)
    _, k_cache, v_cache = _real(1, context)
    mask = _tree(T).cuda()
    cache_len = torch.tensor(context - 3, device="cuda")
    out, lse = hybrid_attention(q, k_new, v_new, k_cache, v_cache, cache_len, mask)
    ref_out, ref_lse = hybrid_attention(q, k_new, v_new, k_cache, v_cache, cache_len, mask, backend="math")
    torch.testing.assert_close(out, ref_out, **BF16)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@needs_flash_attn
@pytest.mark.gpu
@pytest.mark.parametrize("causal, window", [(True, None), (True, 64), (False, None)])
def test_gpu_flash_attn_matches_torch_flash_and_math(causal, window):
    q, k, v = _real(256, 256)
    out, lse = attention(q, k, v, causal=causal, window=window, backend="flash_attn")
    ref_out, ref_lse = attention(q, k, v, causal=causal, window=window, backend="math")
    torch.testing.assert_close(out, ref_out, **BF16)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    if window is None:
        tf_out, tf_lse = attention(q, k, v, causal=causal, backend="torch_flash")
        torch.testing.assert_close(out, tf_out, **BF16)
        torch.testing.assert_close(lse, tf_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("window,T,hkv", [(37, 700, 2), (300, 1000, 1), (5, 531, 4)])
def test_blocked_window_attention_matches_masked_math_with_grads(window, T, hkv):
    from longspec.modules.attention import blocked_window_attention, math_attention, visibility_mask

    g = torch.Generator().manual_seed(T)
    q = torch.randn(1, 4, T, 16, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.randn(1, hkv, T, 16, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(1, hkv, T, 16, generator=g, dtype=torch.float64).requires_grad_()
    mask = visibility_mask(T, T, causal=True, window=window)
    ref_out, ref_lse = math_attention(q, k, v, mask)
    out, lse = blocked_window_attention(q, k, v, window=window)
    # math_attention accumulates in float32 whatever the input dtype: compare at float32 precision.
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    grad_out = torch.randn_like(out)
    ref_grads = torch.autograd.grad((ref_out * grad_out).sum(), (q, k, v))
    grads = torch.autograd.grad((out * grad_out).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_math_backend_routes_long_windows_through_blocks():
    from longspec.modules.attention import attention, math_attention, visibility_mask

    T, window = 600, 20
    q, k, v = (torch.randn(1, 2, T, 8) for _ in range(3))
    out, lse = attention(q, k, v, causal=True, window=window, backend="math")
    ref_out, ref_lse = math_attention(q, k, v, visibility_mask(T, T, causal=True, window=window))
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_aligned_rows_pads_once_and_keeps_values():
    # A verify passes one tree mask to every layer: aligned once, each layer's kernel then reads it in place.
    mask = torch.rand(2, 69, 69) < 0.5
    aligned = aligned_rows(mask)
    assert torch.equal(aligned, mask)
    assert aligned.stride(-2) % 16 == 0 and aligned.data_ptr() % 16 == 0
    assert aligned_rows(aligned) is aligned  # already laid out so: no copy
