"""`naive.commit_path_naive` in one launch: one program per row holds its k path columns as one block.

Shape legend: B rows, k path width, BLOCK the next power of two >= k, S history slots, W ring slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["commit_path_triton"]


@triton.jit
def _commit_path_kernel(
    TOKENS, COUNTS, LENGTHS, HISTORY, RING_POS, RING_APPENDED, POSITIONS, SLOTS,
    k, S, W, stride_tb, stride_tk, stride_hb, stride_rb,
    BLOCK: tl.constexpr, HAS_HISTORY: tl.constexpr, HAS_RING: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    col = i < k
    start = tl.load(LENGTHS + b)
    count = tl.load(COUNTS + b)
    position = start + i  # int64
    tl.store(POSITIONS + b * k + i, position, mask=col)
    if HAS_HISTORY:
        token = tl.load(TOKENS + b * stride_tb + i * stride_tk, mask=col, other=0)
        tl.store(HISTORY + b * stride_hb + tl.minimum(position, S - 1), token, mask=col)
    if HAS_RING:
        appended = tl.load(RING_APPENDED + b)
        kept = col & (i < count)
        slot = (appended + i) % W
        tl.store(RING_POS + b * stride_rb + slot, position, mask=kept)
        tl.store(RING_APPENDED + b, appended + count)
        tl.store(SLOTS + b * k + i, tl.where(kept, slot, -1), mask=col)
    tl.store(LENGTHS + b, start + count)


def commit_path_triton(
    path_tokens: torch.Tensor,
    counts: torch.Tensor,
    lengths: torch.Tensor,
    *,
    history: torch.Tensor | None = None,
    ring_positions: torch.Tensor | None = None,
    ring_appended: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """path_tokens [B, k] long (any strides), counts / lengths [B] long (lengths contiguous, updated), history
    [B, S] long, ring_positions [B, W] long, ring_appended [B] long (each row's slots contiguous) -> (positions
    [B, k], slots [B, k] or None)."""
    B, k = path_tokens.shape
    has_ring = ring_positions is not None
    assert counts.shape == lengths.shape == (B,) and lengths.is_contiguous()
    assert path_tokens.dtype == counts.dtype == lengths.dtype == torch.long
    assert history is None or (
        history.shape[0] == B and history.stride(1) == 1 and history.dtype == torch.long
    )
    if has_ring:
        assert (
            ring_positions.shape[0] == B and ring_positions.stride(1) == 1 and ring_appended.is_contiguous()
        )
        assert k <= ring_positions.shape[1], (
            f"a path of {k} tokens for a ring of {ring_positions.shape[1]} slots"
        )
    positions = torch.empty(B, k, dtype=torch.long, device=path_tokens.device)
    slots = torch.empty(B, k, dtype=torch.long, device=path_tokens.device) if has_ring else None
    dummy = positions  # never dereferenced where its flag is off
    if B:
        _commit_path_kernel[(B,)](
            path_tokens, counts, lengths,
            history if history is not None else dummy,
            ring_positions if has_ring else dummy, ring_appended if has_ring else dummy,
            positions, slots if has_ring else dummy,
            k, history.shape[1] if history is not None else 1, ring_positions.shape[1] if has_ring else 1,
            *path_tokens.stride(), history.stride(0) if history is not None else 0,
            ring_positions.stride(0) if has_ring else 0,
            BLOCK=triton.next_power_of_2(k), HAS_HISTORY=history is not None, HAS_RING=has_ring,
        )  # fmt: skip
    return positions, slots
