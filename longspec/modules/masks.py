"""Which keys a query sees: the sliding-window rule (the one place it is written) and the bottom-right causal /
sliding-window visibility mask of `longspec.modules.attention`.

Shape legend: Tq queries, Tk keys.
"""

from __future__ import annotations

import torch

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


def aligned_rows(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask [..., Tq, Tk] with the same values, its rows padded to 16 bytes (a view of a padded copy;
    the mask itself when it is laid out so already). The Triton attention kernels read such a mask in place and
    copy any other one at every call: a forward that passes one mask to every layer aligns it once."""
    if mask.stride(-1) == 1 and mask.stride(-2) % 16 == 0 and mask.data_ptr() % 16 == 0:
        return mask
    num_keys = mask.shape[-1]
    padded = mask.new_zeros(*mask.shape[:-1], num_keys + (-num_keys % 16))
    padded[..., :num_keys] = mask
    return padded[..., :num_keys]
