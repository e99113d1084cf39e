"""The drafter's inference-time self-attention K/V: the ring buffer of committed tokens (`DrafterCache`, O(window)
memory at any context length) and the uncommitted draft tokens a draft step sees beside it (`DraftNodes`).

Shape legend: B batch, Hkv key/value heads, W window (ring-buffer slots), N draft nodes, Tq queries, n new tokens,
D head dim, S spare slots (scratch for a draft's nodes, after the ring's own).
"""

from __future__ import annotations

import torch

from longspec.drafter.config import DrafterConfig
from longspec.kernels.draft_nodes import draft_nodes
from longspec.modules.constants import arange_once
from longspec.modules.layer_ops import write_kv
from longspec.modules.rope import RotaryEmbedding

__all__ = ["DrafterCache", "DraftNodes"]


class DrafterCache:
    """Ring buffer of the drafter's self-attention K/V: `window` slots per row, whatever the context length.

    Slot s of row b holds the token at `positions[b, s]` (-1 = empty). Tokens are written in order (`append`,
    or `claim_slots` and a fused K/V write), the newest overwriting the oldest; a query at position t sees the
    slots with t - window <= position <= t.

    `spare`: slots each row's K/V storage holds after its W ring slots, never part of the ring (no position, no
    bookkeeping, outside `keys`/`values`): a draft's nodes are written there (`DraftNodes`), so the ring and the
    nodes are one key range without copying the ring each draft (`with_nodes`)."""

    def __init__(
        self,
        config: DrafterConfig,
        batch_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        spare: int = 0,
    ):
        W = config.window
        self.window, self.spare = W, spare
        shape = (batch_size, config.num_kv_heads, W + spare, config.head_dim)
        # The storage: `batch_size` rows for good; the buffer works on its first `rows` (`use_rows`), views whose
        # addresses depend only on that number (what captured draft steps need when a batch shrinks).
        self._storage = (
            torch.zeros(shape, dtype=dtype, device=device),  # keys [B,Hkv,W+S,D] post-RoPE
            torch.zeros(shape, dtype=dtype, device=device),  # values [B,Hkv,W+S,D]
            torch.full((batch_size, W), -1, dtype=torch.long, device=device),  # positions [B,W]
            torch.zeros(batch_size, dtype=torch.long, device=device),  # num_appended [B]: tokens ever written
        )
        # The ring proper: keys/values [B,Hkv,W,D] are views of the storage's first W slots (strided across heads
        # and rows when spare > 0; every reader and writer takes strides), so nothing that works on the ring
        # (fills, masks, row moves) can reach a spare slot.
        keys, values, positions, num_appended = self._storage
        self._ring = (keys[:, :, :W], values[:, :, :W], positions, num_appended)
        self.use_rows(batch_size)

    def use_rows(self, rows: int) -> None:
        """Work on the first `rows` rows of the storage (at most `capacity`)."""
        if not 0 < rows <= self.capacity:
            raise ValueError(f"{rows} rows do not fit a ring buffer of {self.capacity}")
        self.keys, self.values, self.positions, self.num_appended = (t[:rows] for t in self._ring)

    def with_nodes(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """keys, values [rows,Hkv,W+n,D]: the ring's W slots then the first n spare slots, views of the storage
        (no copy), for a draft of n nodes to write its nodes into and attend over; None when n > spare. The
        spare slots are scratch: whatever a draft leaves there is never read as a ring entry."""
        if n > self.spare:
            return None
        rows = self.keys.shape[0]
        return tuple(t[:rows, :, : self.window + n] for t in self._storage[:2])

    @property
    def capacity(self) -> int:
        """Rows the storage holds."""
        return self._storage[0].shape[0]

    @property
    def nbytes(self) -> int:
        """The storage's bytes, spare slots included."""
        return sum(t.numel() * t.element_size() for t in self._storage)

    def reset(self) -> None:
        self.positions.fill_(-1)
        self.num_appended.zero_()

    def claim_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Enter new entries at positions [B,n] (or [n]; n <= window) in the ring's bookkeeping (`positions`,
        `num_appended`) -> slots [B,n]: where each entry's K/V go, for the caller to write (`append`, or the RoPE
        step of `Drafter.fill_cache`). A row's valid entries take its next slots in ring order; entries with
        position < 0 are padding, skipped (their slot is their position: negative, where `write_kv` and
        `qkv_rope` write nothing), so rows may append different numbers of tokens, padded on either side. (A
        round's accepted path, right-padded, is entered by `kernels.path_commit` with the round's other
        bookkeeping: the same slots.)

        Fixed shapes, no host sync (so a CUDA graph can replay it): every entry ranks distinctly in [0, n) -- a
        row's valid entries first, then its padding, whose slot's position is written back as it was."""
        positions = positions.to(self.positions.device).expand(self.positions.shape[0], -1)
        n = positions.shape[1]
        assert 0 < n <= self.window, f"{n} entries for a ring of {self.window} slots"
        valid = positions >= 0  # [B,n]
        ahead = valid.cumsum(1)  # valid entries up to each column, itself included
        num_valid = ahead[:, -1]
        rank = torch.where(valid, ahead - 1, num_valid[:, None] + arange_once(n, valid.device) - ahead)
        slots = (self.num_appended[:, None] + rank) % self.window  # [B,n]
        self.positions.scatter_(1, slots, torch.where(valid, positions, self.positions.gather(1, slots)))
        self.num_appended += num_valid
        # Padding's own (negative) position, not a -1: on CUDA a where's scalar operand is one more launch (a fill).
        return torch.where(valid, slots, positions)

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k/v [B,Hkv,n,D] at positions [B,n] (or [n]) into the ring, at the slots `claim_slots` gives (padding,
        position < 0, is skipped). Only the last `window` columns can survive in the ring: with n > window, rows
        must be unpadded or left-padded, and the dropped columns still count as appended."""
        if positions.dim() == 1:
            positions = positions.expand(k.shape[0], k.shape[2])
        drop = self.drop_older(positions)
        k, v, positions = k[:, :, drop:], v[:, :, drop:], positions[:, drop:]
        write_kv(self.keys, self.values, self.claim_slots(positions), k, v, skip_negative=True)

    def drop_older(self, positions: torch.Tensor) -> int:
        """How many leading columns of positions [B,n] cannot survive in the ring (those before its last `window`:
        unpadded or left-padded rows); they still count as appended (the ring order's clock), so the survivors
        take the slots they would have had one by one. The caller enters only the columns after them."""
        drop = max(positions.shape[1] - self.window, 0)
        if drop:
            self.num_appended += (positions[:, :drop] >= 0).sum(1).to(self.num_appended.device)
        return drop

    def move_rows(self, moves: list[tuple[int, int]], rows: int) -> None:
        """Row `to` takes what row `src` held, for each (to, src) in `moves` in order (an order that is safe in
        place: `longspec.infer.slots.compaction`), then the buffer works on the first `rows` rows."""
        for tensor in self._ring:  # the spare slots hold no row's state
            for to, src in moves:
                tensor[to].copy_(tensor[src])
        self.use_rows(rows)


class DraftNodes:
    """What one draft's levels see beside the ring buffer, laid out once per draft so that a level is a few
    launches with no concatenation: the uncommitted draft tokens' (a tree's nodes, or a chain's) self-attention
    K/V in `keys`/`values` [B,Hkv,N,D] (filled slot range by slot range by `Drafter.tree_level`), stored right
    after the ring (in its spare slots, or after a copy of it), so [ring ++ nodes so far] is one view; every
    node's `positions` [B,N] (known up front: the root's position + the node's depth in a tree, possibly a
    device tensor, no host value read) and their rotary `cos`/`sin` [B,N,D]; and the self-attention mask's ring
    part (which filled slots each node's window reaches), whose node part each level writes from the tree's
    ancestor mask.

    Built by `Drafter.draft_nodes`, in the drafter's compute dtype. Where the ring is in that dtype and has N spare
    slots (`DrafterCache.with_nodes`), the nodes are written into the ring's own storage after its slots and
    [ring ++ nodes] is a view of it (`in_place`: no copy; the ring's slots and bookkeeping are only read); else
    the ring is copied (and converted) once into fresh storage [B,Hkv,W+N,D] ahead of the node slots. Either way
    the keys/values hold the same numbers, so a draft is the same bit for bit.

    `positions` [N] or [B,N]: the nodes' positions, or with `root` (an int or [B]: each row's root position) their
    offsets from it (a tree's node depths). `rotary`: the drafter's `RotaryEmbedding`; the angles come out of the
    layout's own launch where its frequencies are fixed (`fixed_frequencies`), else from `rotary.cos_sin`.
    `ancestors` [B,N,N] or [N,N]: the whole tree's ancestor mask when it is known up front (a chain's), so the
    mask's node part is written here too and the levels write nothing (`self_attention` without a node mask)."""

    def __init__(
        self,
        cache: DrafterCache,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        dtype: torch.dtype | None = None,
        *,
        root: int | torch.Tensor | None = None,
        ancestors: torch.Tensor | None = None,
    ):
        B, Hkv, W, D = cache.keys.shape
        N = positions.shape[-1]  # positions [N] or [B, N]
        self.ring_slots = W
        dtype = cache.keys.dtype if dtype is None else dtype
        in_place = cache.with_nodes(N) if dtype == cache.keys.dtype else None
        self.in_place = in_place is not None
        if in_place is not None:  # [B,Hkv,W+N,D]: ring ++ nodes, views of the ring's storage
            self._keys, self._values = in_place
        else:  # a copy: the ring in another dtype, or with fewer spare slots than nodes
            storage = cache.keys.new_empty((2, B, Hkv, W + N, D), dtype=dtype)
            self._keys, self._values = storage[0], storage[1]  # [B,Hkv,W+N,D]: ring ++ nodes
            self._keys[:, :, :W] = cache.keys  # the ring, copied once per draft
            self._values[:, :, :W] = cache.values
        self.keys, self.values = self._keys[:, :, W:], self._values[:, :, W:]  # node slots [B,Hkv,N,D]
        self.slots = arange_once(N, positions.device).expand(B, N)  # node i -> slot i of `keys`
        # Rows padded to 16 bytes: the attention kernels read the mask in place (kernels.mask_layout). Left
        # unset: a level reads its rows' ring part (set here) and node part up to its own (set by the level).
        self._mask = torch.empty(B, N, -(-(W + N) // 16) * 16, dtype=torch.bool, device=positions.device)
        # The positions [B, N], the ring's mask (with the ancestors, the node part too), `_near` [B, N, N] (node j
        # within node i's window) and the rotary cos / sin [B, N, D]: one launch on CUDA (`kernels.draft_nodes`).
        self.masked_nodes = ancestors is not None
        inv_freq = rotary.fixed_frequencies()
        rope = None if inv_freq is None else (inv_freq.to(positions.device), rotary.attention_scaling, dtype)
        self.positions, self._near, angles = draft_nodes(
            positions,
            root,
            cache.positions,
            cache.window,
            self._mask[:, :, : W + N if self.masked_nodes else W],
            ancestors,
            rope=rope,
        )
        self.cos, self.sin = rotary.cos_sin(self.positions, dtype=dtype) if angles is None else angles

    def self_attention(
        self, level: slice, node_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values [B,Hkv,W+stop,D] and mask [B,P,W+stop] of the nodes in `level` (P of them; stop =
        level.stop): the ring within each node's window, and node j iff node_mask[.., i, j] ([P, stop] or
        [B, P, stop]: the tree's ancestor mask, self included) and within the window. node_mask None: the
        ancestors given up front decide (`masked_nodes`)."""
        W, stop = self.ring_slots, level.stop
        if node_mask is not None:
            torch.logical_and(node_mask, self._near[:, level, :stop], out=self._mask[:, level, W : W + stop])
        else:
            assert self.masked_nodes, "a level without its node mask, and no ancestors were given up front"
        return self._keys[:, :, : W + stop], self._values[:, :, : W + stop], self._mask[:, level, : W + stop]
