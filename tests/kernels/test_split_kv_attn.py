"""split_kv_attn (Triton; the CPU interpreter in CI) vs its float32 naive reference."""

import pytest
import torch

pytest.importorskip("triton")
# The interpreter evaluates log2(0) for empty splits with numpy, which warns; the result (-inf) is intended.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

from _kernel_helpers import (  # noqa: E402
    DTYPES,
    assert_attn_close,
    beam_tree,
    random_tree,
    tree_mask,
    tree_masks,
)

from longspec.kernels.fused_mask_attn import fused_mask_attn, fused_mask_attn_naive  # noqa: E402
from longspec.kernels.split_kv_attn import split_kv_attn, split_kv_attn_naive  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, H, Hkv, Tq, Tmax, D, cache_len, dtype=torch.float32, device=DEVICE):
    q = torch.randn(B, H, Tq, D, device=device, dtype=dtype)
    k_cache = torch.randn(B, Hkv, Tmax, D, device=device, dtype=dtype)
    v_cache = torch.randn(B, Hkv, Tmax, D, device=device, dtype=dtype)
    # Slots past the filled prefix hold garbage in a real cache: NaN there must never leak into the result.
    for b, n in enumerate(torch.as_tensor(cache_len).expand(B).tolist()):
        k_cache[b, :, n:] = float("nan")
        v_cache[b, :, n:] = float("nan")
    return q, k_cache, v_cache


def _poisoned(q):
    B, H, Tq, _ = q.shape
    return dict(
        out=torch.full_like(q, float("nan")), lse=torch.full((B, H, Tq), float("nan"), device=q.device)
    )


@pytest.mark.parametrize(
    "B, H, Hkv, Tq, Tmax, D, cache_len, num_splits",
    [
        (1, 4, 4, 7, 200, 32, 137, None),  # GQA 1, cache_len not a multiple of the tile
        (2, 8, 2, 69, 300, 32, 237, 3),  # a 69-node tree, GQA 4, several splits
        (1, 8, 1, 16, 150, 24, 129, 5),  # GQA 8, head dim not a power of 2
        (1, 4, 2, 5, 200, 16, 70, 6),  # more splits than tiles: empty splits must get zero weight
        (
            1,
            3,
            1,
            1,
            2600,
            16,
            2500,
            70,
        ),  # an AR step: the reduce loads splits in two chunks, the last ones empty
    ],
)
def test_matches_naive(B, H, Hkv, Tq, Tmax, D, cache_len, num_splits):
    q, k_cache, v_cache = _inputs(B, H, Hkv, Tq, Tmax, D, cache_len)
    config = None if num_splits is None else {"num_splits": num_splits}
    out, lse = split_kv_attn(q, k_cache, v_cache, cache_len, 0.3, config=config, **_poisoned(q))
    assert_attn_close(out, lse, *split_kv_attn_naive(q, k_cache, v_cache, cache_len, 0.3), torch.float32)


@pytest.mark.parametrize("cache_len", [torch.tensor(101), torch.tensor([101, 37]), 0, torch.tensor([0, 64])])
def test_device_lengths_and_empty_cache(cache_len):
    q, k_cache, v_cache = _inputs(2, 4, 2, 9, 160, 16, cache_len)
    out, lse = split_kv_attn(q, k_cache, v_cache, cache_len, 0.25, config={"num_splits": 2}, **_poisoned(q))
    assert_attn_close(out, lse, *split_kv_attn_naive(q, k_cache, v_cache, cache_len, 0.25), torch.float32)


def _union_reference(q, k_cache, v_cache, n, k_new, v_new, mask, scale):
    """One masked attention over [cache[:n] ++ new]: the cache fully visible, the new keys by `mask`."""
    keys = torch.cat([k_cache[:, :, :n], k_new], dim=2)
    values = torch.cat([v_cache[:, :, :n], v_new], dim=2)
    full_mask = torch.cat(
        [torch.ones(*mask.shape[:-1], n, dtype=torch.bool, device=mask.device), mask], dim=-1
    )
    return fused_mask_attn_naive(q, keys, values, full_mask, scale)


@pytest.mark.parametrize("cache_len, num_splits", [(77, None), (0, 2), (torch.tensor([50, 3]), 4)])
def test_hybrid_equals_attention_over_union(cache_len, num_splits):
    # Hybrid verify attention as attention.py runs it: fused_mask_attn over the new tokens, folded into the
    # split-KV reduce == one masked attention over [cache ++ new], per batch row (lengths and masks differ).
    B, H, Hkv, Tq, Tmax, D = 2, 8, 2, 13, 128, 16
    q, k_cache, v_cache = _inputs(B, H, Hkv, Tq, Tmax, D, cache_len)
    k_new, v_new = torch.randn(2, B, Hkv, Tq, D, device=DEVICE)
    mask = torch.rand(B, Tq, Tq, device=DEVICE) < 0.5
    mask[0, 4] = False  # this row sees only the cache (or nothing at all when the cache is empty)
    config = None if num_splits is None else {"num_splits": num_splits}
    tree = fused_mask_attn(q, k_new, v_new, mask, 0.25)
    out, lse = split_kv_attn(
        q, k_cache, v_cache, cache_len, 0.25, merge_with=tree, config=config, **_poisoned(q)
    )
    for b, n in enumerate(torch.as_tensor(cache_len).expand(B).tolist()):
        ref = _union_reference(q[b : b + 1], k_cache[b : b + 1], v_cache[b : b + 1], n, k_new[b : b + 1],
                               v_new[b : b + 1], mask[b : b + 1], 0.25)  # fmt: skip
        assert_attn_close(out[b : b + 1], lse[b : b + 1], *ref, torch.float32)


@pytest.mark.parametrize(
    "B, H, Hkv, Tq, Tmax, D, cache_len, num_splits",
    [
        (1, 4, 2, 2, 200, 16, 137, None),  # a chain of 2 (one draft + its root)
        (2, 6, 2, 5, 300, 32, torch.tensor([130, 251]), 2),  # row 0's diagonal straddles the two splits
        (1, 3, 1, 4, 260, 16, 129, 37),  # more splits than tiles: the diagonal in a short last split
        (2, 4, 4, 3, 100, 24, torch.tensor([3, 64]), 3),  # a row whose only keys are the queries' own
        (2, 4, 2, 1, 200, 16, torch.tensor([150, 97]), None),  # an AR step: the plain launch, same keys
    ],
)
def test_causal_tail_matches_naive_and_the_hybrid_path(B, H, Hkv, Tq, Tmax, D, cache_len, num_splits):
    """causal=True: the queries are each row's last Tq keys; == the float32 reference, and == what the hybrid
    path computes for the same chain (cache part over [0, n - Tq) merged with fused_mask_attn under a causal
    mask over the chain's own keys)."""
    q, k_cache, v_cache = _inputs(B, H, Hkv, Tq, Tmax, D, cache_len)
    config = None if num_splits is None else {"num_splits": num_splits}
    out, lse = split_kv_attn(q, k_cache, v_cache, cache_len, 0.3, causal=True, config=config, **_poisoned(q))
    ref = split_kv_attn_naive(q, k_cache, v_cache, cache_len, 0.3, causal=True)
    assert_attn_close(out, lse, *ref, torch.float32)
    causal = torch.ones(Tq, Tq, dtype=torch.bool, device=DEVICE).tril()
    for b, n in enumerate(torch.as_tensor(cache_len).expand(B).tolist()):
        rows = slice(b, b + 1)
        k_new, v_new = k_cache[rows, :, n - Tq : n], v_cache[rows, :, n - Tq : n]
        tree = fused_mask_attn(q[rows], k_new, v_new, causal, 0.3)
        hybrid = split_kv_attn(q[rows], k_cache[rows], v_cache[rows], n - Tq, 0.3, merge_with=tree)
        assert_attn_close(out[rows], lse[rows], *hybrid, torch.float32)


def _forest_parents(branches, levels):
    """Parents of a forest of `branches` chains of `levels` nodes from one root, laid out level by level."""
    return [-1] + [0 if t <= branches else t - branches for t in range(1, 1 + branches * levels)]


@pytest.mark.parametrize(
    "B, H, Hkv, branches, levels, Tmax, D, cache_len, num_splits",
    [
        (1, 4, 2, 2, 1, 200, 16, 137, None),  # a root and two one-node branches
        (2, 6, 2, 2, 3, 300, 32, torch.tensor([130, 251]), 2),  # row 0's tail straddles the two splits
        (1, 3, 1, 4, 3, 260, 16, 129, 37),  # more splits than tiles: the tail in a short last split
        (2, 4, 4, 4, 1, 100, 24, torch.tensor([5, 64]), 3),  # a row whose only keys are the forest's own
        (2, 8, 1, 4, 3, 200, 16, torch.tensor([13, 190]), 4),  # GQA 8: 104 rows, two row blocks
        (3, 4, 2, 1, 3, 160, 16, torch.tensor([70, 4, 159]), 2),  # branches=1: the plain chain
    ],
)
def test_causal_forest_matches_naive_and_the_hybrid_path(
    B, H, Hkv, branches, levels, Tmax, D, cache_len, num_splits
):
    """causal=True with `branches`: the tail is a forest laid out level by level; == the float32 reference, which
    == the hybrid path for the same forest (cache part over [0, n - Tq) merged with fused_mask_attn under the
    forest's ancestor mask, built from its parents)."""
    Tq = 1 + branches * levels
    q, k_cache, v_cache = _inputs(B, H, Hkv, Tq, Tmax, D, cache_len)
    config = None if num_splits is None else {"num_splits": num_splits}
    out, lse = split_kv_attn(q, k_cache, v_cache, cache_len, 0.3, causal=True, branches=branches, config=config,
                             **_poisoned(q))  # fmt: skip
    ref = split_kv_attn_naive(q, k_cache, v_cache, cache_len, 0.3, causal=True, branches=branches)
    assert_attn_close(out, lse, *ref, torch.float32)
    ancestors = tree_mask(_forest_parents(branches, levels), DEVICE)
    for b, n in enumerate(torch.as_tensor(cache_len).expand(B).tolist()):
        rows = slice(b, b + 1)
        k_new, v_new = k_cache[rows, :, n - Tq : n], v_cache[rows, :, n - Tq : n]
        tree = fused_mask_attn(q[rows], k_new, v_new, ancestors, 0.3)
        hybrid = split_kv_attn(q[rows], k_cache[rows], v_cache[rows], n - Tq, 0.3, merge_with=tree)
        assert_attn_close(ref[0][rows], ref[1][rows], *hybrid, torch.float32)


def test_forest_needs_whole_levels():
    q, k_cache, v_cache = _inputs(1, 2, 1, 6, 64, 16, 40)
    for fn in (split_kv_attn, split_kv_attn_naive):
        for branches in (2, 0):  # Tq - 1 = 5 is not a multiple of 2; 0 branches
            with pytest.raises(ValueError, match="branches"):
                fn(q, k_cache, v_cache, 40, 0.3, causal=True, branches=branches)


def test_default_outputs_are_laid_out_for_the_output_projection():
    """Without an `out` buffer both kernels write [B, Tq, H, D] in memory, so merging the heads for o_proj is a
    view (no copy kernel per layer); the values are the reference's, in the hybrid (merged) path too."""
    B, H, Hkv, Tq, Tmax, D, n = 2, 4, 2, 5, 96, 16, 70
    q, k_cache, v_cache = _inputs(B, H, Hkv, Tq, Tmax, D, n)
    k_new, v_new = torch.randn(2, B, Hkv, Tq, D, device=DEVICE)
    mask = torch.rand(B, Tq, Tq, device=DEVICE) < 0.5
    tree = fused_mask_attn(q, k_new, v_new, mask, 0.25)
    out, lse = split_kv_attn(q, k_cache, v_cache, n, 0.25, merge_with=tree)
    for o in (tree[0], out):
        assert o.transpose(1, 2).is_contiguous()
        assert o.transpose(1, 2).reshape(B, Tq, H * D).data_ptr() == o.data_ptr()
    assert_attn_close(*tree, *fused_mask_attn_naive(q, k_new, v_new, mask, 0.25), torch.float32)
    ref = _union_reference(q, k_cache, v_cache, n, k_new, v_new, mask, 0.25)
    assert_attn_close(out, lse, *ref, torch.float32)


def test_merge_with_equals_attention_over_both_key_sets():
    # A part computed elsewhere (here the naive masked attention) folded into the reduce.
    B, H, Hkv, Tq, Tmax, D, n = 1, 8, 2, 11, 128, 16, 77
    q, k_cache, v_cache = _inputs(B, H, Hkv, Tq, Tmax, D, n)
    k_new, v_new = torch.randn(2, B, Hkv, Tq, D, device=DEVICE)
    mask = torch.rand(Tq, Tq, device=DEVICE) < 0.5
    mask[4] = False  # this row sees only the cache
    new_out, new_lse = fused_mask_attn_naive(q, k_new, v_new, mask, 0.25)
    out, lse = split_kv_attn(q, k_cache, v_cache, n, 0.25, merge_with=(new_out, new_lse), **_poisoned(q))
    ref = _union_reference(q, k_cache, v_cache, n, k_new, v_new, mask, 0.25)
    assert_attn_close(out, lse, *ref, torch.float32)


# ------------------------------------------------------------------- ragged batches (per-sequence lengths)

# Lengths of a ragged batch against Tmax = 130 slots and 64-wide tiles: an empty cache, one slot, a length that
# is not a multiple of the tile, and the full cache.
RAGGED_TMAX = 130
RAGGED_LENGTHS = [0, 1, 67, RAGGED_TMAX]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "H, Hkv, Tq, D, len_dtype",
    [
        (4, 4, 63, 16, torch.int32),  # GQA 1, T = 63
        (8, 2, 7, 32, torch.int64),  # GQA 4
        (8, 1, 9, 24, torch.int32),  # GQA 8, head dim not a power of 2
    ],
)
def test_ragged_lengths_match_naive(H, Hkv, Tq, D, len_dtype, dtype):
    lengths = torch.tensor(RAGGED_LENGTHS, dtype=len_dtype, device=DEVICE)
    q, k_cache, v_cache = _inputs(len(RAGGED_LENGTHS), H, Hkv, Tq, RAGGED_TMAX, D, lengths, dtype)
    out, lse = split_kv_attn(q, k_cache, v_cache, lengths, 0.3, config={"num_splits": 3}, **_poisoned(q))
    ref_out, ref_lse = split_kv_attn_naive(q, k_cache, v_cache, lengths, 0.3)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all(), "an empty cache gives (0, -inf)"
    assert_attn_close(out, lse, ref_out, ref_lse, dtype)


def test_ragged_default_plan_is_for_the_capacity():
    # Without a config the split count comes from Tmax (never from the lengths): it must still be exact for
    # rows far shorter than the plan, including the ones whose every split but the first is empty.
    lengths = torch.tensor([1, 300, 0, 65], device=DEVICE)
    q, k_cache, v_cache = _inputs(4, 8, 2, 5, 300, 16, lengths)
    out, lse = split_kv_attn(q, k_cache, v_cache, lengths, 0.25, **_poisoned(q))
    assert_attn_close(out, lse, *split_kv_attn_naive(q, k_cache, v_cache, lengths, 0.25), torch.float32)


def test_split_count_one_wave_for_few_rows_four_for_a_tree(monkeypatch):
    # The plan on a 132-SM device: few rows (an AR step, a chain) stream K/V in one wave of programs, or two where
    # a split has 16+ programs (a batch, a chain of two row blocks); a tree's rows (>= 2 row blocks of 64 rows)
    # in four; never under 2 tiles of keys per split.
    from longspec.kernels.split_kv_attn import triton as kernel

    monkeypatch.setattr(kernel, "_num_sms", lambda device: 132)

    def plan(rows, kv_programs, slots):
        return kernel.default_config(rows, kv_programs, slots, 128, torch.device(DEVICE))["num_splits"]

    assert plan(4, 8, 8192 + 128) == 16  # 8B AR step: 8 kv heads x 16 splits ~ 132 programs
    assert plan(68, 8, 32768) == 16  # a chain of 17: two row blocks per kv head, two waves
    assert plan(4, 64, 32768) == 4  # batch 8: two waves
    assert plan(3, 48, 4096) == 6  # SmolLM2 at batch 16
    assert plan(296, 8, 32768) == 13  # a 74-node tree: 5 row blocks, ~4 waves
    assert plan(3, 3, 4096) == 32  # SmolLM2's AR step at 4K: capped at 4096 / 128 splits
    assert plan(3, 3, 8192 + 128) == 44  # and at 8K one wave
    # Qwen2.5-Coder-0.5B's AR step: one wave (66) capped at the reduce's 64 parts per load
    assert plan(7, 2, 32768 + 128) == 64
    assert plan(4, 8, 100) == 1


def test_int_length_equals_device_lengths_bitwise():
    # One plan (same num_splits), one kernel: an int length and the same length per row on the device give the
    # same bits, so moving the engine to device lengths changes nothing for a batch of one.
    B, n = 2, 101
    q, k_cache, v_cache = _inputs(B, 8, 2, 11, 160, 16, n)
    config = {"num_splits": 3}
    out_int, lse_int = split_kv_attn(q, k_cache, v_cache, n, 0.25, config=config)
    out_dev, lse_dev = split_kv_attn(q, k_cache, v_cache, torch.full((B,), n, device=DEVICE), 0.25,
                                     config=config)  # fmt: skip
    assert torch.equal(out_int, out_dev) and torch.equal(lse_int, lse_dev)


def test_lengths_strided_view_and_out_of_range():
    # A [B] view with a non-unit stride (a column of a per-sequence state table) is read in place, and lengths
    # the host cannot check (they stay on the device) are clamped to [0, Tmax] instead of reading past the cache.
    Tmax = 96
    table = torch.tensor([[70, -1], [-3, -1], [Tmax + 50, -1]], device=DEVICE)
    lengths = table[:, 0]
    assert lengths.stride(0) == 2
    q, k_cache, v_cache = _inputs(3, 4, 2, 5, Tmax, 16, lengths.clamp(0, Tmax))
    out, lse = split_kv_attn(q, k_cache, v_cache, lengths, 0.25, config={"num_splits": 2}, **_poisoned(q))
    ref = split_kv_attn_naive(q, k_cache, v_cache, lengths.clamp(0, Tmax), 0.25)
    assert_attn_close(out, lse, *ref, torch.float32)


def _ragged_hybrid(q, k_cache, v_cache, lengths, k_new, v_new, masks, scale, config):
    """Verify attention of a batch: each row's tree under its own mask, merged into its own cache prefix."""
    tree = fused_mask_attn(q, k_new, v_new, masks, scale)
    return split_kv_attn(q, k_cache, v_cache, lengths, scale, merge_with=tree, config=config, **_poisoned(q))


@pytest.mark.parametrize("pin_splits", [True, False])
def test_ragged_batch_equals_each_sequence_alone(pin_splits):
    # The property the batched engine relies on: row b of a ragged batch (its own cache length, its own tree)
    # gets what a batch of one with that length and tree gets. With the split count pinned the bits are equal;
    # with the default plan (which depends on B through the program count) it is equal to rounding.
    B, H, Hkv, T, Tmax, D = 4, 8, 2, 21, 130, 16
    lengths = torch.tensor([67, 0, RAGGED_TMAX, 1], device=DEVICE)
    q, k_cache, v_cache = _inputs(B, H, Hkv, T, Tmax, D, lengths)
    k_new, v_new = torch.randn(2, B, Hkv, T, D, device=DEVICE)
    gen = torch.Generator().manual_seed(7)
    masks = tree_masks([random_tree(T, gen) for _ in range(B)], DEVICE)
    masks[1, 5] = False  # with the empty cache: a row that sees nothing at all -> (0, -inf)
    config = {"num_splits": 3} if pin_splits else None
    out, lse = _ragged_hybrid(q, k_cache, v_cache, lengths, k_new, v_new, masks, 0.25, config)
    assert torch.isneginf(lse[1, :, 5]).all() and (out[1, :, 5] == 0).all()
    for b in range(B):
        row = slice(b, b + 1)
        alone = _ragged_hybrid(q[row], k_cache[row], v_cache[row], lengths[row], k_new[row], v_new[row],
                               masks[row], 0.25, config)  # fmt: skip
        if pin_splits:
            assert torch.equal(out[row], alone[0]) and torch.equal(lse[row], alone[1]), f"row {b}"
        else:
            assert_attn_close(out[row], lse[row], *alone, torch.float32)
        n = int(lengths[b])
        ref = _union_reference(
            q[row], k_cache[row], v_cache[row], n, k_new[row], v_new[row], masks[row], 0.25
        )
        assert_attn_close(out[row], lse[row], *ref, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("context, num_queries", [(8192, 69), (32768 + 17, 74), (131072 - 5, 74)])
def test_gpu_real_shapes(dtype, context, num_queries):
    Tmax = 131072
    q, k_cache, v_cache = _inputs(1, 32, 8, num_queries, Tmax, 128, context, dtype, "cuda")
    out, lse = split_kv_attn(q, k_cache, v_cache, context, 128**-0.5, **_poisoned(q))
    ref = split_kv_attn_naive(q, k_cache, v_cache, context, 128**-0.5)
    assert_attn_close(out, lse, *ref, dtype)
    # The length on the device (the CUDA-graph path: splits planned for the full Tmax, bounds read in-kernel).
    out_dev, lse_dev = split_kv_attn(q, k_cache, v_cache, torch.tensor(context, device="cuda"), 128**-0.5)
    assert_attn_close(out_dev, lse_dev, *ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, H, Hkv, D, chain", [(1, 32, 8, 128, 5), (4, 9, 3, 64, 2), (16, 9, 3, 64, 5)])
def test_gpu_causal_chains(dtype, B, H, Hkv, D, chain):
    """Chain verifies at the 8B and SmolLM2 shapes on a ragged batch, lengths on the device (graph path)."""
    lengths = torch.tensor([8192 - 3 * b for b in range(B)], device="cuda")
    q, k_cache, v_cache = _inputs(B, H, Hkv, chain, 8192 + 64, D, lengths, dtype, "cuda")
    out, lse = split_kv_attn(q, k_cache, v_cache, lengths, D**-0.5, causal=True, **_poisoned(q))
    assert_attn_close(
        out, lse, *split_kv_attn_naive(q, k_cache, v_cache, lengths, D**-0.5, causal=True), dtype
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "B, H, Hkv, D, branches, levels", [(1, 32, 8, 128, 4, 8), (4, 9, 3, 64, 2, 4), (16, 9, 3, 64, 8, 3)]
)
def test_gpu_causal_forests(dtype, B, H, Hkv, D, branches, levels):
    """Lookup-forest verifies (branches chains from one root, level by level) at the 8B and SmolLM2 shapes on
    a ragged batch, lengths on the device (graph path)."""
    Tq = 1 + branches * levels
    lengths = torch.tensor([8192 - 3 * b for b in range(B)], device="cuda")
    q, k_cache, v_cache = _inputs(B, H, Hkv, Tq, 8192 + 64, D, lengths, dtype, "cuda")
    out, lse = split_kv_attn(q, k_cache, v_cache, lengths, D**-0.5, causal=True, branches=branches,
                             **_poisoned(q))  # fmt: skip
    ref = split_kv_attn_naive(q, k_cache, v_cache, lengths, D**-0.5, causal=True, branches=branches)
    assert_attn_close(out, lse, *ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("context", [8192, 131072 - 74])
def test_gpu_hybrid(context):
    # Verify attention at Llama-3.1-8B shapes: 74 tree tokens (a 69-node tree + 5 more) vs a long cache.
    T, dtype = 74, torch.bfloat16
    q, k_cache, v_cache = _inputs(1, 32, 8, T, context, 128, context, dtype, "cuda")
    k_new, v_new = torch.randn(2, 1, 8, T, 128, device="cuda", dtype=dtype)
    mask = tree_mask(beam_tree() + [int(torch.randint(0, i, (1,))) for i in range(69, T)], "cuda")
    # The hybrid path: fused_mask_attn over the tree, merged into the split-KV reduce (`merge_with`).
    tree = fused_mask_attn(q, k_new, v_new, mask, 128**-0.5)
    out, lse = split_kv_attn(q, k_cache, v_cache, context, 128**-0.5, merge_with=tree, **_poisoned(q))
    ref = _union_reference(q, k_cache, v_cache, context, k_new, v_new, mask, 128**-0.5)
    assert_attn_close(out, lse, *ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_ragged_batch_in_a_cuda_graph(dtype):
    # A ragged batch at Llama-3.1-8B shapes, captured once and replayed after the lengths (and trees) change in
    # place: the launch must not depend on the lengths' values.
    B, T, Tmax = 4, 74, 32768 + 74
    lengths = torch.tensor([32768, 8192 + 3, 1, 0], device="cuda", dtype=torch.int32)
    q, k_cache, v_cache = _inputs(B, 32, 8, T, Tmax, 128, Tmax, dtype, "cuda")
    k_new, v_new = torch.randn(2, B, 8, T, 128, device="cuda", dtype=dtype)
    masks = tree_masks([beam_tree() + [int(torch.randint(0, i, (1,))) for i in range(69, T)] for _ in range(B)],
                       "cuda")  # fmt: skip
    out, lse = torch.full_like(q, float("nan")), torch.full((B, 32, T), float("nan"), device="cuda")

    def step():
        tree = fused_mask_attn(q, k_new, v_new, masks, 128**-0.5)
        split_kv_attn(q, k_cache, v_cache, lengths, 128**-0.5, merge_with=tree, out=out, lse=lse)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_lengths in ([32768, 8192 + 3, 1, 0], [5, Tmax - T, 0, 4096 - 1]):
        lengths.copy_(torch.tensor(new_lengths))
        masks[0] = masks[0].roll(1, dims=0).tril()  # a different tree, same buffer
        out.fill_(float("nan"))
        graph.replay()
        for b, n in enumerate(new_lengths):
            row = slice(b, b + 1)
            ref = _union_reference(q[row], k_cache[row], v_cache[row], n, k_new[row], v_new[row], masks[row],
                                   128**-0.5)  # fmt: skip
            assert_attn_close(out[row], lse[row], *ref, dtype)
