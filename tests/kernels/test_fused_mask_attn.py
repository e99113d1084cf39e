"""fused_mask_attn (Triton; the CPU interpreter in CI) vs its float32 naive reference."""

import pytest
import torch

pytest.importorskip("triton")
# The interpreter evaluates log2(0) for fully masked rows with numpy, which warns; the result (-inf) is intended.
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

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(B, H, Hkv, Tq, Tk, D, dtype=torch.float32, device=DEVICE):
    q = torch.randn(B, H, Tq, D, device=device, dtype=dtype)
    k = torch.randn(B, Hkv, Tk, D, device=device, dtype=dtype)
    v = torch.randn(B, Hkv, Tk, D, device=device, dtype=dtype)
    return q, k, v


def _poisoned(q):
    B, H, Tq, _ = q.shape
    return torch.full_like(q, float("nan")), torch.full((B, H, Tq), float("nan"), device=q.device)


@pytest.mark.parametrize(
    "B, H, Hkv, D, parents",
    [
        (1, 8, 2, 32, beam_tree()),  # the drafter's 69-node tree, GQA 4
        (2, 4, 4, 16, random_tree(63, torch.Generator().manual_seed(1))),  # T = 63, GQA 1
        (1, 8, 1, 24, random_tree(17, torch.Generator().manual_seed(2))),  # GQA 8, head dim not a power of 2
    ],
)
def test_tree_mask_matches_naive(B, H, Hkv, D, parents):
    T = len(parents)
    q, k, v = _qkv(B, H, Hkv, T, T, D)
    mask = tree_mask(parents, DEVICE)
    out, lse = fused_mask_attn(q, k, v, mask, 0.3, out=_poisoned(q)[0], lse=_poisoned(q)[1])
    ref_out, ref_lse = fused_mask_attn_naive(q, k, v, mask, 0.3)
    assert_attn_close(out, lse, ref_out, ref_lse, torch.float32)


def test_per_batch_mask_and_fully_masked_rows():
    B, H, Hkv, Tq, Tk, D = 2, 4, 2, 20, 37, 16  # non-square, ragged against the 64-wide tiles
    q, k, v = _qkv(B, H, Hkv, Tq, Tk, D)
    mask = torch.rand(B, Tq, Tk, device=DEVICE) < 0.4
    mask[0, 3] = False  # rows that see nothing: out 0, lse -inf
    mask[1, :5] = False
    out_buf, lse_buf = _poisoned(q)
    out, lse = fused_mask_attn(q, k, v, mask, 0.25, out=out_buf, lse=lse_buf)
    assert out.data_ptr() == out_buf.data_ptr() and lse.data_ptr() == lse_buf.data_ptr()
    ref_out, ref_lse = fused_mask_attn_naive(q, k, v, mask, 0.25)
    assert torch.isneginf(lse[0, :, 3]).all() and torch.isneginf(lse[1, :, :5]).all()
    assert_attn_close(out, lse, ref_out, ref_lse, torch.float32)


def test_strided_inputs():
    # [B, T, H, D] storage viewed as [B, H, T, D] (what a model's projections give before .transpose).
    B, H, Hkv, T, D = 1, 4, 2, 33, 16
    q = torch.randn(B, T, H, D, device=DEVICE).transpose(1, 2)
    k = torch.randn(B, T, Hkv, D, device=DEVICE).transpose(1, 2)
    v = torch.randn(B, T, Hkv, D, device=DEVICE).transpose(1, 2)
    mask = tree_mask(random_tree(T, torch.Generator().manual_seed(3)), DEVICE)
    out, lse = fused_mask_attn(q, k, v, mask, 0.25)
    assert_attn_close(out, lse, *fused_mask_attn_naive(q, k, v, mask, 0.25), torch.float32)


def test_mask_layouts():
    # A mask with 16-byte-aligned rows (a [:, :T] view of a padded buffer) is read in place; any other layout
    # is copied to one. Both give the same attention.
    from longspec.kernels.online_softmax import mask_operand

    T = 21
    mask = tree_mask(random_tree(T, torch.Generator().manual_seed(4)), DEVICE)
    padded = torch.zeros(T, 32, dtype=torch.bool, device=DEVICE)
    padded[:, :T] = mask
    view = padded[:, :T]
    operand, batch_stride, row_stride = mask_operand(view)
    assert operand.data_ptr() == view.data_ptr() and (batch_stride, row_stride) == (0, 32)
    copied, _, row_stride = mask_operand(mask)
    assert row_stride % 16 == 0 and torch.equal(copied.bool(), mask)
    _, batch_stride, _ = mask_operand(mask.expand(3, T, T).contiguous())
    assert batch_stride > 0

    q, k, v = _qkv(1, 4, 2, T, T, 16)
    out_view, lse_view = fused_mask_attn(q, k, v, view, 0.3)
    out_copy, lse_copy = fused_mask_attn(q, k, v, mask.t().contiguous().t(), 0.3)  # column-major: copied
    assert torch.equal(out_view, out_copy) and torch.equal(lse_view, lse_copy)
    assert_attn_close(out_view, lse_view, *fused_mask_attn_naive(q, k, v, mask, 0.3), torch.float32)


def _different_trees(batch: int, num_nodes: int, seed: int) -> list[list[int]]:
    """One tree per batch row, all different: the beam tree (69 nodes, cut or extended) and random trees."""
    gen = torch.Generator().manual_seed(seed)
    beam = (beam_tree() + random_tree(num_nodes, gen)[69:])[:num_nodes]
    return [beam] + [random_tree(num_nodes, gen) for _ in range(batch - 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "B, H, Hkv, D, T",
    [
        (3, 8, 2, 32, 69),  # the drafter's 69-node tree in row 0, GQA 4
        (2, 4, 4, 16, 63),  # T = 63, GQA 1
        (3, 8, 1, 24, 17),  # GQA 8, head dim not a power of 2
    ],
)
def test_batched_trees_match_naive(B, H, Hkv, D, T, dtype):
    # One tree per sequence ([B, T, T]), in one launch; each row equals that row alone under its own tree.
    q, k, v = _qkv(B, H, Hkv, T, T, D, dtype)
    masks = tree_masks(_different_trees(B, T, seed=T), DEVICE)
    assert not torch.equal(masks[0], masks[1])
    out_buf, lse_buf = _poisoned(q)
    out, lse = fused_mask_attn(q, k, v, masks, 0.3, out=out_buf, lse=lse_buf)
    assert_attn_close(out, lse, *fused_mask_attn_naive(q, k, v, masks, 0.3), dtype)
    for b in range(B):
        row = slice(b, b + 1)
        alone_out, alone_lse = fused_mask_attn(q[row], k[row], v[row], masks[b], 0.3)  # a shared [T, T] mask
        assert torch.equal(out[row], alone_out) and torch.equal(lse[row], alone_lse), f"row {b}"


def test_mask_batch_of_one_is_shared():
    # [1, T, T] broadcasts over the batch exactly like [T, T].
    B, T = 3, 21
    q, k, v = _qkv(B, 4, 2, T, T, 16)
    mask = tree_mask(random_tree(T, torch.Generator().manual_seed(5)), DEVICE)
    shared = fused_mask_attn(q, k, v, mask, 0.3)
    broadcast = fused_mask_attn(q, k, v, mask[None], 0.3)
    assert torch.equal(shared[0], broadcast[0]) and torch.equal(shared[1], broadcast[1])
    with pytest.raises(AssertionError, match="mask"):
        fused_mask_attn(q, k, v, mask.expand(2, T, T), 0.3)  # neither 1 nor B trees


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_nodes", [69, 74])
def test_gpu_real_shapes(dtype, num_nodes):
    q, k, v = _qkv(1, 32, 8, num_nodes, num_nodes, 128, dtype, "cuda")
    # The 69-node beam tree plus, for 74, five re-fed tokens hanging off random nodes.
    parents = beam_tree() + [int(torch.randint(0, i, (1,))) for i in range(69, num_nodes)]
    mask = tree_mask(parents, "cuda")
    out_buf, lse_buf = _poisoned(q)
    out, lse = fused_mask_attn(q, k, v, mask, 128**-0.5, out=out_buf, lse=lse_buf)
    assert_attn_close(out, lse, *fused_mask_attn_naive(q, k, v, mask, 128**-0.5), dtype)


@pytest.mark.parametrize("Tq", [1, 16])
def test_ring_sized_keys_take_wider_tiles(Tq):
    # A drafter's ring (a few hundred keys, head dim 64): the default tile is 128 keys; a ragged last tile, rows
    # whose ring is partly masked, and the same result as with 64-key tiles.
    B, H, Hkv, Tk, D = 1, 14, 2, 300, 64
    q, k, v = _qkv(B, H, Hkv, Tq, Tk, D)
    mask = torch.rand(B, Tq, Tk, device=DEVICE) < 0.8
    mask[..., -Tq:] = torch.ones(Tq, Tq, dtype=torch.bool, device=DEVICE).tril()
    out, lse = fused_mask_attn(q, k, v, mask, 0.125, out=_poisoned(q)[0], lse=_poisoned(q)[1])
    assert_attn_close(out, lse, *fused_mask_attn_naive(q, k, v, mask, 0.125), torch.float32)
    narrow = fused_mask_attn(q, k, v, mask, 0.125, block_n=64)
    assert_attn_close(out, lse, *narrow, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_ring_shapes(dtype):
    # The drafter's self-attention over a 512-slot ring at the Qwen2.5-Coder-0.5B shape: a chain's query and a
    # 16-node tree level, with 128-key tiles.
    for Tq in (1, 16):
        q, k, v = _qkv(1, 14, 2, Tq, 512 + Tq, 64, dtype, "cuda")
        mask = torch.rand(1, Tq, 512 + Tq, device="cuda") < 0.9
        mask[..., -Tq:] = torch.ones(Tq, Tq, dtype=torch.bool, device="cuda").tril()
        out_buf, lse_buf = _poisoned(q)
        out, lse = fused_mask_attn(q, k, v, mask, 0.125, out=out_buf, lse=lse_buf)
        assert_attn_close(out, lse, *fused_mask_attn_naive(q, k, v, mask, 0.125), dtype)
