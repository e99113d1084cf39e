"""Which keys a query sees: the sliding-window rule (the one place it is written) and the bottom-right causal /
sliding-window visibility mask of `longspec.modules.attention`.

Shape legend: Tq queries, Tk keys.
"""

from __future__ import annotations

import torch

from longspec.kernels.mask_layout import aligned_rows  # the layout the attention kernels read in place

__all__ = ["aligned_rows", "within_window", "visibility_mask"]


def within_window(query_pos, key_pos, window: int):
    """The sliding-window rule, the one place it is written: the key at position j is within the window of the
    query at position t iff t - j <= window ("the token + `window` previous tokens"). Positions are tensors
    (broadcast against each other) or ints; causality (j <= t) is the caller's separate test."""
    return (query_pos - key_pos) <= window


def visibility_mask(
    num_queries: int, num_keys: int, *, causal: bool, window: int | None, device: torch.device | None = None
) -> torch.Tensor | None:
    """[Tq, Tk] bool mask (True = visible) for bottom-right causal / sliding-window attention."""
    if not causal and window is None:
        return None
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    k_pos = torch.arange(num_keys, device=device)[None, :]
    mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
    if causal:
        mask &= k_pos <= q_pos
    if window is not None:
        mask &= within_window(q_pos, k_pos, window)
    return mask
