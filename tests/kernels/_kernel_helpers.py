"""Shared helpers of the kernel tests (imported by file name: tests/ directories are not packages)."""

from __future__ import annotations

import pytest
import torch

from longspec.infer.candidates import DEFAULT_TREE_WIDTHS

# Max-abs error relative to the reference's max-abs, per input dtype: float32 runs in the interpreter (exact
# dots) or TF32-free paths; bf16/fp16 round P to the input dtype before P @ V.
REL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
LSE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def tree_mask(parents: list[int], device=None) -> torch.Tensor:
    """[T, T] ancestor-or-self mask of a tree given each node's parent index (-1 for the root)."""
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        assert p < i, "parents must precede children"
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask.to(device)


def random_tree(num_nodes: int, generator: torch.Generator | None = None) -> list[int]:
    """Parent list of a random tree (node 0 is the root)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, num_nodes)]


def beam_tree(widths=DEFAULT_TREE_WIDTHS) -> list[int]:
    """The drafter's tree shape (ALGORITHM §4.1): a root, then per level `w` nodes whose parents are spread over
    the previous level -- 1 + 68 = 69 nodes for the default widths."""
    parents, prev = [-1], [0]
    for w in widths:
        level = list(range(len(parents), len(parents) + w))
        parents += [prev[i % len(prev)] for i in range(w)]
        prev = level
    return parents


def assert_attn_close(out, lse, ref_out, ref_lse, dtype):
    """out/lse vs the float32 reference; rows with no visible key must be exactly (0, -inf)."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten (NaN) or NaN outputs"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "fully masked rows differ"
    assert (out[empty] == 0).all(), "fully masked rows must output 0"
    ref_out, out = ref_out.float(), out.float()
    scale = ref_out.abs().max().clamp_min(1e-6)
    err = (out - ref_out).abs().max() / scale
    assert err <= REL_TOL[dtype], f"out relative error {err:.2e} > {REL_TOL[dtype]:.0e}"
    if (~empty).any():
        lse_err = (lse[~empty] - ref_lse[~empty]).abs().max()
        assert lse_err <= LSE_TOL[dtype] * ref_lse[~empty].abs().max().clamp_min(1.0), (
            f"lse error {lse_err:.2e}"
        )


# The dtypes every kernel test runs in. Triton's CPU interpreter multiplies the raw bit patterns of bfloat16
# tl.dot operands (triton-lang/triton#11584, "not supported yet"), so bfloat16 runs on a GPU only.
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="the Triton interpreter's tl.dot is wrong for bf16 (#11584)"
        ),
    ),
]


def tree_masks(parent_lists, device=None) -> torch.Tensor:
    """[B, T, T]: one ancestor mask per batch row, each a different tree (a list of parent lists, same T)."""
    return torch.stack([tree_mask(parents, device) for parents in parent_lists])
