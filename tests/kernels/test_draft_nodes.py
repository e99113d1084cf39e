"""The draft-node layout kernel (the CPU interpreter in CI) against its reference: positions given whole ([N] and
[B, N]) or as offsets from a root (an int or [B]); ring rows that wrapped, are partly empty or empty; windows
smaller than the ring, of one tile and of several (a ring longer than a tile); a chain and the default tree, more
nodes than the window. Mask buffers are prefilled all True and all False in turn, so an element the kernel leaves
unwritten shows, and the caller's padding columns past the ring's are checked untouched. The nodes' rotary angles,
asked with the layout, are `rope_angles`' own numbers (one jitted function computes both): checked equal to that
kernel's, bit for bit, in float32 and bf16, with and without attention scaling, a partial rope among them."""

import pytest
import torch

pytest.importorskip("triton")

from longspec.kernels.draft_nodes import draft_nodes, draft_nodes_naive  # noqa: E402
from longspec.kernels.draft_nodes import triton as kernels  # noqa: E402
from longspec.kernels.rope_angles import rope_angles, rope_angles_naive  # noqa: E402
from longspec.modules.masks import within_window  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TREE_DEPTHS = torch.tensor([0] + [1] * 4 + [2] * 16 + [3] * 16 + [4] * 16 + [5] * 16)  # [4, 16, 16, 16, 16]


def _ring(B: int, W: int, seed: int) -> torch.Tensor:
    """Ring positions [B, W]: a wrapped row (W consecutive positions in ring order), a partly filled one (-1
    slots), an empty one, and random rows."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.roll(torch.arange(1000, 1000 + W), W // 3), torch.where(torch.arange(W) < W // 2, 40, -1)]
    rows += [torch.full((W,), -1)]
    rows += [torch.randint(-1, 2000, (W,), generator=gen) for _ in range(B - 3)]
    return torch.stack(rows[:B])


def _layout(offsets, root, ring, window, fill: bool, ancestors=None):
    """Both sides on the same inputs, the kernel's mask a [B, N, W (+ N) + pad] buffer prefilled with `fill`."""
    B, W = ring.shape
    N = offsets.shape[-1]
    width = W if ancestors is None else W + N
    want_mask = torch.empty(B, N, width, dtype=torch.bool)
    want = draft_nodes_naive(offsets, root, ring, window, want_mask, ancestors)
    buffer = torch.full((B, N, width + 13), fill, dtype=torch.bool, device=DEVICE)
    dev_root = root.to(DEVICE) if isinstance(root, torch.Tensor) else root
    dev_ancestors = None if ancestors is None else ancestors.to(DEVICE)
    got = kernels.draft_nodes_triton(
        offsets.to(DEVICE), dev_root, ring.to(DEVICE), window, buffer[:, :, :width], dev_ancestors
    )
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert got[2] is None and want[2] is None  # no angles unless asked
    assert torch.equal(buffer[:, :, :width].cpu(), want_mask)
    assert (buffer[:, :, width:] == fill).all(), "a padding column was written"
    return want[:2], want_mask


# (ring slots, window, node depths): a window of the whole ring (one tile), inside it, a ring of two tiles; the
# default tree. Each with every form of the positions (the tree with two: the interpreter runs a program at a time).
CASES = [(8, 8, "chain"), (64, 16, "chain"), (700, 600, "chain"), (64, 16, "tree")]


@pytest.mark.parametrize("W, window, shape", CASES)
@pytest.mark.parametrize("fill", [True, False])
def test_kernel_equals_reference(W, window, shape, fill):
    B = 5
    ring = _ring(B, W, seed=W)
    depths = torch.arange(12) if shape == "chain" else TREE_DEPTHS
    roots = torch.tensor([1000 + W, 45, 0, 1500, 2100])
    forms = [
        (depths, roots),
        ((roots[:, None] + depths)[:, ::2], None),  # strided
        (depths, 1003),
        (roots[:, None] + depths, None),
        (depths + 7, None),  # [N]: every row alike
    ]
    for offsets, root in forms[: 2 if shape == "tree" else None]:
        (positions, near), mask = _layout(offsets, root, ring, window, fill)
        # The reference is the rule written out: filled, causal and within the window.
        q, slots = positions[:, :, None], ring[:, None, :]
        assert torch.equal(mask, (slots >= 0) & (slots <= q) & within_window(q, slots, window))
        assert torch.equal(near, within_window(q, positions[:, None, :], window))


@pytest.mark.parametrize("batched", [False, True])
def test_ancestors_write_the_node_part(batched):
    # A chain's ancestor mask ([N, N], or [B, N, N] as the engine's forests hold it), and a random one: the node
    # part is ancestors & near, the ring part as without them.
    B, W, window, N = 3, 16, 6, 10
    ring, roots = _ring(B, W, seed=5), torch.tensor([1010, 30, 3])
    gen = torch.Generator().manual_seed(7)
    for ancestors in (torch.ones(N, N, dtype=torch.bool).tril(), torch.rand(N, N, generator=gen) < 0.5):
        if batched:
            ancestors = ancestors.expand(B, N, N)
        for fill in (True, False):
            (positions, near), mask = _layout(torch.arange(N), roots, ring, window, fill, ancestors)
            assert torch.equal(mask[:, :, W:], ancestors & near)
            (_, _), ring_only = _layout(torch.arange(N), roots, ring, window, fill)
            assert torch.equal(mask[:, :, :W], ring_only)


def test_one_node_one_row_and_the_route():
    ring = _ring(3, 16, seed=1)[:1]
    (positions, near), mask = _layout(torch.tensor([0]), torch.tensor([1010]), ring, 8, fill=True)
    assert positions.tolist() == [[1010]] and near.tolist() == [[[True]]]
    # The dispatch: the reference off CUDA, whatever the inputs.
    if DEVICE == "cpu":
        out = torch.empty(1, 1, 16, dtype=torch.bool)
        assert torch.equal(draft_nodes(torch.tensor([0]), 1010, ring, 8, out)[0], positions)
        assert torch.equal(out, mask)


@pytest.mark.parametrize("half, scaling", [(16, 1.0), (3, 1.18)])  # a power of two; a partial rope, scaled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_angles_are_rope_angles_own(half, scaling, dtype):
    B, W, window = 3, 16, 8
    ring, roots = _ring(B, W, seed=2), torch.tensor([131_071, 45, 2**24 + 1])
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, 2 * half, 2, dtype=torch.float) / (2 * half)))).to(DEVICE)
    for depths in (torch.arange(6), TREE_DEPTHS[:21]):
        mask = torch.empty(B, depths.numel(), W, dtype=torch.bool, device=DEVICE)
        positions, near, (cos, sin) = kernels.draft_nodes_triton(
            depths.to(DEVICE),
            roots.to(DEVICE),
            ring.to(DEVICE),
            window,
            mask,
            rope=(inv_freq, scaling, dtype),
        )
        want_cos, want_sin = rope_angles(positions, inv_freq, scaling, dtype)
        assert cos.dtype == sin.dtype == dtype and cos.shape == (B, depths.numel(), 2 * half)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        # the layout itself is what it is without the angles
        plain_mask = torch.empty_like(mask)
        plain = kernels.draft_nodes_triton(
            depths.to(DEVICE), roots.to(DEVICE), ring.to(DEVICE), window, plain_mask
        )
        assert (
            torch.equal(positions, plain[0]) and torch.equal(near, plain[1]) and torch.equal(mask, plain_mask)
        )
    # the reference computes them with `rope_angles_naive`
    ref_mask = torch.empty(B, 6, W, dtype=torch.bool)
    ref = draft_nodes_naive(
        torch.arange(6), roots, ring, window, ref_mask, rope=(inv_freq.cpu(), scaling, dtype)
    )
    want = rope_angles_naive(ref[0], inv_freq.cpu(), scaling, dtype)
    assert torch.equal(ref[2][0], want[0]) and torch.equal(ref[2][1], want[1])


@pytest.mark.gpu
def test_gpu_route_in_a_draft_equals_reference():
    # On CUDA `draft_nodes` takes the kernel (inference mode): the default tree at batch 4 with a 512-slot ring.
    ring = _ring(4, 512, seed=3)
    roots = torch.tensor([1600, 44, 0, 1999])
    with torch.inference_mode():
        mask = torch.zeros(4, 69, 512 + 80, dtype=torch.bool, device="cuda")
        got = draft_nodes(TREE_DEPTHS.cuda(), roots.cuda(), ring.cuda(), 512, mask[:, :, :512])
    want_mask = torch.empty(4, 69, 512, dtype=torch.bool)
    want = draft_nodes_naive(TREE_DEPTHS, roots, ring, 512, want_mask)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    # and its angles are the reference's, bit for bit: on CUDA both are the CUDA math library's cosf / sinf
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    with torch.inference_mode():
        mask = torch.zeros(4, 69, 512, dtype=torch.bool, device="cuda")
        _, _, angles = draft_nodes(
            TREE_DEPTHS.cuda(),
            roots.cuda(),
            ring.cuda(),
            512,
            mask,
            rope=(inv_freq.cuda(), 1.0, torch.bfloat16),
        )
    want_angles = rope_angles_naive(want[0].cuda(), inv_freq.cuda(), 1.0, torch.bfloat16)
    assert torch.equal(angles[0], want_angles[0]) and torch.equal(angles[1], want_angles[1])
    assert torch.equal(mask[:, :, :512].cpu(), want_mask) and not mask[:, :, 512:].any()
