"""The committed tokens by position, per row, on the device: what the drafter's ring catches up from
(`DraftStep.catch_up`) and what prompt-lookup drafts are looked up in (`pld.device_lookup`).

Shape legend: B sequences (rows), S slots per row (the target cache's).

A round's tokens enter it in the round's commit (`kernels.path_commit`).

It belongs to no drafter: PLD has none and still needs it, so the engine owns one next to the target cache, sized
like it (a position is a cache slot), and hands it to the drafter's side. Row b holds its committed text at
positions [0, n_b) (n_b the row's committed length, `StaticKVCache.lengths_t`); positions >= n_b are stale:
the padding of earlier paths, a frozen row's rejected drafts, a warm-up's tokens. Readers must mask them.
"""

from __future__ import annotations

import torch

__all__ = ["TokenHistory"]


class TokenHistory:
    """Token ids by position [rows, slots] on the device, allocated once per engine (static / captured steps keep
    its address); a batch works on its first rows (`tokens`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._tokens: torch.Tensor | None = None  # [capacity rows, slots]
        self.tokens: torch.Tensor | None = None  # its first rows (the batch's)

    def allocate(self, batch_size: int, slots: int) -> bool:
        """Allocate on first use, or when a call needs more rows or slots; later calls keep it (working on its
        first rows), so captured steps stay valid. Returns whether it was (re)allocated: the steps that read
        the old one must go."""
        old = self._tokens
        if old is not None and old.shape[0] >= batch_size and old.shape[1] >= slots:
            self.use_rows(batch_size)
            return False
        self._tokens = self.tokens = old = None  # freed before the new one
        self._tokens = torch.zeros(batch_size, max(slots, 1), dtype=torch.long, device=self.device)
        self.tokens = self._tokens
        return True

    def use_rows(self, rows: int) -> None:
        """Work on the first `rows` rows (a view whose address depends only on `rows`)."""
        self.tokens = self._tokens[:rows]

    def move_rows(self, moves: list[tuple[int, int]], rows: int) -> None:
        """Row `to` takes row `src`'s tokens for each (to, src) (`slots.compaction`)."""
        for to, src in moves:
            self._tokens[to].copy_(self._tokens[src])
        self.use_rows(rows)

    def prefill(self, prompts: list[torch.Tensor]) -> None:
        """Each row's prompt at positions [0, len)."""
        for row, prompt in enumerate(prompts):
            self.tokens[row, : prompt.numel()] = prompt
