"""The target's static KV cache: allocated once, written in place, committed by length.

Shape legend: L layers, B batch, Hkv key/value heads, Tmax slots, D head dim, T new tokens, k accepted tokens.

Row b's slots [0, lengths[b]) hold its committed sequence (a batch of sequences of different lengths: ragged).
A forward over T new tokens per row (a prefill chunk, one AR token or a draft tree) first writes its K/V into
each row's pending slots [lengths[b], lengths[b] + T) of every layer; then either `commit(T)` keeps them
(prefill / AR; per-row counts for a ragged prefill), or `move_path` + `commit(counts)` keep only each row's
accepted tree nodes, moving their K/V to [lengths[b], lengths[b] + k_b) for all layers at once. Nothing is re-fed
to the target after verification.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["StaticKVCache"]


class StaticKVCache:
    """keys / values: [L, B, Hkv, Tmax, D] (one tensor each, so a commit is one gather per tensor)."""

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if max_len < 1:
            raise ValueError(f"KV cache max_len must be positive, got {max_len}")
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        # The storage: `batch_size` rows, for good. The cache works on its first `rows` (`use_rows`): views whose
        # addresses depend only on that number, so the steps captured for a batch bucket stay valid when a batch
        # shrinks to it and in later calls (one layer's slab, keys[l], stays contiguous).
        self._keys = torch.zeros(shape, dtype=dtype, device=device)
        self._values = torch.zeros(shape, dtype=dtype, device=device)
        # Device mirror of `lengths` for ragged / static-shape steps (CUDA graphs read it; set by `sync_length`).
        self._lengths_t = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.lengths = [0] * batch_size  # committed tokens per row (host)
        self.use_rows(batch_size)
        # While rounds are in flight the device lengths lead (each round's commit advances them on the device)
        # and the host's follow as rounds settle: `sync_length` must not write the host's behind them.
        self.device_leads = False

    @classmethod
    def for_target(
        cls, target, *, max_len: int, batch_size: int = 1, dtype=None, device=None
    ) -> StaticKVCache:
        weight = target.embed_tokens.weight
        return cls(
            num_layers=target.num_layers,
            batch_size=batch_size,
            num_kv_heads=target.num_kv_heads,
            max_len=max_len,
            head_dim=target.head_dim,
            dtype=dtype or weight.dtype,
            device=device or weight.device,
        )

    def use_rows(self, rows: int) -> None:
        """Work on the first `rows` rows of the storage (a batch of `rows`; at most `capacity`), their lengths
        kept (new rows start at 0)."""
        if not 0 < rows <= self.capacity:
            raise ValueError(f"{rows} rows do not fit a cache of {self.capacity}")
        self.keys, self.values = self._keys[:, :rows], self._values[:, :rows]  # [L, rows, Hkv, Tmax, D]
        self.lengths_t = self._lengths_t[:rows]
        self.lengths = (self.lengths + [0] * rows)[:rows]
        self._synced: list[int] | None = None  # the lengths `lengths_t` holds (None: unknown)

    @property
    def capacity(self) -> int:
        """Rows the storage holds (the largest batch this cache serves)."""
        return self._keys.shape[1]

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def uniform(self) -> bool:
        """Whether every row holds the same number of committed tokens (always so at batch 1)."""
        return min(self.lengths) == max(self.lengths)

    @property
    def length(self) -> int:
        """The committed length shared by every row (batch 1, or a uniform batch)."""
        assert self.uniform, f"rows hold different lengths {self.lengths}: read `lengths`"
        return self.lengths[0]

    @length.setter
    def length(self, value: int) -> None:
        self.lengths = [int(value)] * self.batch_size

    def nbytes(self) -> int:
        """Bytes of the storage (every row, used or not)."""
        return self._keys.numel() * self._keys.element_size() * 2

    def reset(self) -> None:
        self.length = 0
        self.lengths_t.zero_()
        self._synced = [0] * self.batch_size

    def sync_length(self) -> None:
        """Copy `lengths` to `lengths_t` before a ragged or static-shape step: a device fill when the rows agree,
        else one small host-to-device copy (no device value is read). Nothing when the device already holds
        these lengths (a round's step and the ring's catch-up start from the same ones), nor while the
        device leads (`device_leads`: decoding with rounds in flight)."""
        if self.device_leads or self._synced == self.lengths:
            return
        if self.uniform:
            self.lengths_t.fill_(self.lengths[0])
        else:
            self.lengths_t.copy_(torch.tensor(self.lengths))
        self._synced = list(self.lengths)

    def advance(self, counts: torch.Tensor) -> None:
        """Add each row's committed `counts` [B] to the device lengths, on the device only (a round's commit, also
        inside a captured step). The host lengths follow when the round settles (`commit`); the caller says
        `device_advanced` once the step has run (a replayed graph runs no Python)."""
        self.lengths_t.add_(counts)

    def device_advanced(self) -> None:
        """The device lengths moved without the host's: the next `sync_length` writes them again."""
        self._synced = None

    @contextmanager
    def lead_on_device(self) -> Iterator[None]:
        """Decode with rounds in flight: the device lengths are synced from the host once, then lead (every
        round's commit advances them on the device) and the host's catch up as rounds settle; `sync_length`
        writes nothing meanwhile. Every round launched inside must have settled before the block ends."""
        self.sync_length()
        self.device_leads = True
        try:
            yield
        finally:
            self.device_leads = False
            self.device_advanced()  # equal again once every round settled; after an exception, unknown

    def move_rows(self, moves: list[tuple[int, int]], rows: int) -> None:
        """Row `to` takes what row `src` held (K/V and length), for each (to, src) in `moves` in order (a safe
        order: `slots.compaction`), then the cache works on the first `rows` rows. In place: no second cache is
        allocated (at 32K x 16 rows on an 8B target a copy would not fit beside it)."""
        for cache in (self._keys, self._values):
            for to, src in moves:
                cache[:, to].copy_(cache[:, src])
        lengths = list(self.lengths)
        for to, src in moves:
            self._lengths_t[to].copy_(self._lengths_t[src])
            lengths[to] = lengths[src]
        self.use_rows(rows)
        self.lengths = lengths[:rows]

    def check_room(self, num_tokens: int) -> None:
        """Raise when a forward of `num_tokens` per row would write past the reserved slots."""
        stop = max(self.lengths) + num_tokens
        if stop > self.max_len:
            raise ValueError(
                f"KV cache overflow: {stop} tokens > max_len {self.max_len}; raise the engine's max_len"
            )

    def commit(self, num_tokens: int | list[int]) -> None:
        """Keep the pending tokens written by the last forward (prefill chunk, AR step): `num_tokens` for every
        row, or a count per row (a ragged prefill chunk, whose shorter rows were padded)."""
        counts = num_tokens if isinstance(num_tokens, list) else [num_tokens] * self.batch_size
        self.lengths = [n + c for n, c in zip(self.lengths, counts, strict=True)]
        assert max(self.lengths) <= self.max_len

    def move_path(self, paths: torch.Tensor, starts: torch.Tensor) -> None:
        """Keep each row's accepted tree nodes, fixed shapes: slot starts[b] + paths[b, i] -> starts[b] + i for
        every i < k (paths [B, k] root-first, ascending, padded; starts [B] on the device), all layers at once.
        Slots past a row's count receive padding, but they are pending slots (the next forward overwrites them
        before any read); the gather reads before the scatter writes, so overlap is safe. The host lengths are
        not touched: `commit(counts)` follows."""
        L, B, Hkv, _, D = self.keys.shape
        k = paths.shape[1]
        src = (paths + starts[:, None]).clamp(min=0)  # [B, k]; a padded entry reads some slot, harmlessly
        dst = starts[:, None] + torch.arange(k, device=self.keys.device)
        for cache in (self.keys, self.values):
            moved = cache.gather(3, src[None, :, None, :, None].expand(L, B, Hkv, k, D))
            cache.scatter_(3, dst[None, :, None, :, None].expand(L, B, Hkv, k, D), moved)
