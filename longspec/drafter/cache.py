"""The drafter's inference-time self-attention K/V: the ring buffer of committed tokens (`DrafterCache`, O(window)
memory at any context length) and the uncommitted draft tokens a draft step sees beside it (`DraftNodes`).

Shape legend: B batch, Hkv key/value heads, W window (ring-buffer slots), N draft nodes, Tq queries, n new tokens,
D head dim.
"""

from __future__ import annotations

import torch

from longspec.drafter.config import DrafterConfig
from longspec.modules.attention import within_window

__all__ = ["DrafterCache", "DraftNodes"]


class DrafterCache:
    """Ring buffer of the drafter's self-attention K/V: `window` slots per row, whatever the context length.

    Slot s of row b holds the token at `positions[b, s]` (-1 = empty). `append` writes tokens in order, the
    newest overwriting the oldest; a query at position t sees the slots with t - window <= position <= t."""

    def __init__(
        self,
        config: DrafterConfig,
        batch_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        W = config.window
        self.window = W
        shape = (batch_size, config.num_kv_heads, W, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [B,Hkv,W,D] post-RoPE
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [B,Hkv,W,D]
        self.positions = torch.full((batch_size, W), -1, dtype=torch.long, device=device)  # [B,W]
        self.num_appended = torch.zeros(
            batch_size, dtype=torch.long, device=device
        )  # [B] tokens ever written

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.keys, self.values, self.positions, self.num_appended)
        )

    def reset(self) -> None:
        self.positions.fill_(-1)
        self.num_appended.zero_()

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k/v [B,Hkv,n,D], positions [B,n] (or [n]); entries with position < 0 are padding and skipped,
        so rows may append different numbers of tokens. Only each row's last `window` tokens are kept."""
        B, n = k.shape[0], k.shape[2]
        if positions.dim() == 1:
            positions = positions.expand(B, n)
        positions = positions.to(self.positions.device)
        valid = positions >= 0  # [B,n]
        order = valid.long().cumsum(1) - 1  # index of each valid token among its row's new tokens
        keep = valid & (order >= valid.sum(1, keepdim=True) - self.window)  # no two writes to one slot
        rows, cols = keep.nonzero(as_tuple=True)
        slots = (self.num_appended[rows] + order[rows, cols]) % self.window
        # Advanced indexing on dims (0, 2) puts the index axis first: [N,Hkv,D] on both sides.
        self.keys[rows, :, slots] = k[rows, :, cols].to(self.keys.dtype)
        self.values[rows, :, slots] = v[rows, :, cols].to(self.values.dtype)
        self.positions[rows, slots] = positions[rows, cols]
        self.num_appended += valid.sum(1)

    def visible_mask(self, query_positions: torch.Tensor) -> torch.Tensor:
        """query_positions [B,Tq] -> bool [B,Tq,W]: slot visible iff filled and within the query's window."""
        pos = self.positions[:, None, :]  # [B,1,W]
        q = query_positions.to(pos.device)[:, :, None]  # [B,Tq,1]
        return (pos >= 0) & (pos <= q) & within_window(q, pos, self.window)


class DraftNodes:
    """Self-attention K/V of the uncommitted draft tokens (a tree's nodes, or a chain) that a draft step sees
    beside the ring buffer: `keys`/`values` [B,Hkv,N,D] in the ring's dtype, filled slot range by slot range by
    `Drafter.tree_level`; `positions` [B,N] (or [N]) long: every node's position, known up front (the root's
    position + the node's depth in a tree), possibly computed from a device tensor (no host value read)."""

    def __init__(self, cache: DrafterCache, positions: torch.Tensor):
        B, Hkv, _, D = cache.keys.shape
        if positions.dim() == 1:
            positions = positions.expand(B, -1)
        self.positions = positions
        self.keys = cache.keys.new_zeros(B, Hkv, positions.shape[1], D)
        self.values = torch.zeros_like(self.keys)
