"""Reference commit bookkeeping of a round (the semantics `triton.py` follows).

Shape legend: B rows, k the round's path width (root first, padded past each row's count), S history slots per
row, W drafter ring slots.
"""

from __future__ import annotations

import torch

__all__ = ["commit_path_naive"]


def commit_path_naive(
    path_tokens: torch.Tensor,
    counts: torch.Tensor,
    lengths: torch.Tensor,
    *,
    history: torch.Tensor | None = None,
    ring_positions: torch.Tensor | None = None,
    ring_appended: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A round's accepted paths, path_tokens [B, k] with counts [B] (how many each row keeps: 0 for a frozen row),
    the root of row b at position lengths[b] (its committed length, before this round):
    - history [B, S] (the token history), when given, takes every path column at its position (clamped to the
      last slot): the padding writes ahead of the committed length, where later rounds overwrite it before
      anything reads it;
    - the drafter ring's bookkeeping, when given (ring_positions [B, W], ring_appended [B]): each row's kept
      tokens take its next ring slots in order ((appended + i) % W, k <= W), their positions recorded there;
      appended grows by the count;
    - lengths [B] advance by counts (in place, last).
    Returns (positions [B, k] = lengths + i, every column; ring slots [B, k], -1 for a column past the count
    (its K/V must not be written), or None without a ring). Fixed shapes, device values only."""
    k = path_tokens.shape[1]
    steps = torch.arange(k, device=path_tokens.device)
    positions = lengths[:, None] + steps  # [B, k]
    if history is not None:
        history.scatter_(1, positions.clamp(max=history.shape[1] - 1), path_tokens)
    slots = None
    if ring_positions is not None:
        window = ring_positions.shape[1]
        assert k <= window, f"a path of {k} tokens for a ring of {window} slots"
        kept = steps < counts[:, None]  # [B, k]: a row's kept tokens are its first ones
        ring_slots = (ring_appended[:, None] + steps) % window  # distinct within a row
        ring_positions.scatter_(
            1, ring_slots, torch.where(kept, positions, ring_positions.gather(1, ring_slots))
        )
        ring_appended += counts
        slots = torch.where(kept, ring_slots, -1)
    lengths += counts
    return positions, slots
