"""Reference layout of a draft's nodes (the semantics `triton.py` follows).

Shape legend: B rows, N draft nodes, W ring slots.
"""

from __future__ import annotations

import torch

from longspec.kernels.rope_angles.naive import rope_angles_naive

__all__ = ["draft_nodes_naive"]


def draft_nodes_naive(
    offsets: torch.Tensor,
    root: int | torch.Tensor | None,
    ring_positions: torch.Tensor,
    window: int,
    mask: torch.Tensor,
    ancestors: torch.Tensor | None = None,
    *,
    rope: tuple[torch.Tensor, float, torch.dtype] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The nodes' positions, their self-attention masks beside the ring and (with `rope`) their rotary angles:
    - positions [B, N] = root + offsets: offsets [N] or [B, N] long (a tree's node depths, or the positions
      themselves with root None), root an int or [B] (each row's root position);
    - the ring part of `mask` [B, N, W (+ N)] (written in place, any strides: a view of the caller's padded mask):
      node i sees ring slot s iff the slot is filled and within its window, i.e. max(p_i - window, 0) <=
      ring_positions[b, s] <= p_i (ring_positions [B, W], -1 for an empty slot; written as clamp(q, low, p_i) ==
      q, the one range a clamp and a test give);
    - near [B, N, N]: node j lies within node i's window, p_j >= p_i - window;
    - with `ancestors` [B, N, N] or [N, N] bool (the whole tree's ancestor mask, when it is known up front: a
      chain's), also the node part mask[..., W:] = ancestors & near;
    - with `rope` = (inv_freq [R] float32, attention_scaling, dtype): the positions' rotary (cos, sin) [B, N, 2R]
      in dtype (`kernels.rope_angles`).
    Returns (positions, near, (cos, sin) or None). Positions are >= 0 (a draft's nodes come after the committed
    tokens)."""
    B, W = ring_positions.shape
    positions = (
        offsets if root is None else (root[:, None] if isinstance(root, torch.Tensor) else root) + offsets
    )
    positions = positions.expand(B, -1)  # [B, N]
    start = positions - window  # key position j is within the window of query p iff j >= p - window
    low = start.clamp(min=0)[:, :, None]  # [B, N, 1]
    ring = ring_positions[:, None, :]  # [B, 1, W]
    torch.eq(torch.clamp(ring, low, positions[:, :, None]), ring, out=mask[:, :, :W])
    near = positions[:, None, :] >= start[:, :, None]  # [B, N, N]
    if ancestors is not None:
        torch.logical_and(ancestors, near, out=mask[:, :, W:])
    angles = None if rope is None else rope_angles_naive(positions, *rope)
    return positions, near, angles
