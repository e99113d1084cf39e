"""Anchor-offset position ids for stage-1 training (docs/ALGORITHM.md §3.1).

Short sequences (~1K tokens) are trained at positions spread over the long context the drafter will meet:
the first `num_anchors` tokens keep positions 0..num_anchors-1 (attention sinks), every later token is shifted
by one random offset o ~ U[0, max_len - L] per row, e.g. [0, 1, 2, 3, 16261, 16262, ...]. Every position stays
< max_len. The same ids go to the target and to the drafter. `default_max_len` is the paper's MAX_LEN as a rule of the
target's trained context.
"""

from __future__ import annotations

import torch

__all__ = ["anchor_offset_position_ids", "default_max_len", "PAPER_MAX_LEN"]

# The paper's MAX_LEN for its 32K- and 128K-context targets; its 16K-context target got 15000.
PAPER_MAX_LEN = 30_000


def default_max_len(max_positions: int) -> int:
    """MAX_LEN for a target trained on `max_positions` positions: the paper's 15000 per 16384 (a little under the
    trained length, as for its 16K target), at most PAPER_MAX_LEN (its value for 32K and longer). 16384 -> 15000,
    32768 / 40960 / 131072 -> 30000, 8192 -> 7500, 4096 -> 3750."""
    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")
    return min(PAPER_MAX_LEN, max(1, max_positions * 15_000 // 16_384))


def anchor_offset_position_ids(
    batch_size: int,
    seq_len: int,
    *,
    max_len: int,
    num_anchors: int = 4,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """-> [batch_size, seq_len] long. Offsets are drawn on the CPU (`generator` must be a CPU generator)
    and moved to `device`, so seeded runs reproduce on any device."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    if num_anchors < 0:
        raise ValueError(f"num_anchors must be >= 0, got {num_anchors}")
    if max_len < seq_len:
        raise ValueError(
            f"max_len ({max_len}) must be >= seq_len ({seq_len}): positions must stay below the context the "
            "target supports (ALGORITHM §3.1: 15K for 16K-context targets, 30K for longer)"
        )
    offsets = torch.randint(0, max_len - seq_len + 1, (batch_size, 1), generator=generator)  # [B,1]
    positions = torch.arange(seq_len).expand(batch_size, seq_len)
    shifted = positions >= num_anchors
    position_ids = torch.where(shifted, positions + offsets, positions)
    return position_ids.to(device) if device is not None else position_ids
