"""A draft's node layout in one launch: the nodes' positions (the root's position + each node's depth), their
self-attention masks beside the drafter's ring buffer (which filled ring slots each node's window reaches, and
which nodes lie within each node's window; for a chain, whose ancestors are known up front, its whole mask) and,
when asked, their rotary angles. `naive.py` is the reference (many small PyTorch launches on CUDA in every
draft, inside a launch-bound draft step); `triton.py` is one program per node, whose angles are
`kernels.rope_angles`' own arithmetic (one jitted function), so a draft's nodes rotate exactly as every other
token does."""

from __future__ import annotations

import torch

from longspec.kernels.draft_nodes.naive import draft_nodes_naive

__all__ = ["draft_nodes", "draft_nodes_naive"]


def draft_nodes(
    offsets: torch.Tensor,
    root: int | torch.Tensor | None,
    ring_positions: torch.Tensor,
    window: int,
    mask: torch.Tensor,
    ancestors: torch.Tensor | None = None,
    *,
    rope: tuple[torch.Tensor, float, torch.dtype] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """`naive.draft_nodes_naive`: the Triton kernel on CUDA outside autograd (imported on first use), the reference
    elsewhere."""
    fn = draft_nodes_naive
    if offsets.is_cuda and not torch.is_grad_enabled():
        from longspec.kernels.draft_nodes.triton import draft_nodes_triton as fn
    return fn(offsets, root, ring_positions, window, mask, ancestors, rope=rope)


def __getattr__(name):
    # The Triton kernel is imported on first use so that importing this package never imports Triton.
    if name == "draft_nodes_triton":
        from longspec.kernels.draft_nodes.triton import draft_nodes_triton

        return draft_nodes_triton
    raise AttributeError(name)
