"""A batch's slots: which prompt each slot of the batch decodes and which slots are still running. On static
shapes a batch runs in its power-of-two bucket (padding slots frozen from the start), and moves to the smaller
bucket once half of it has finished (the engine's loop also asks for a long enough tail:
GenerationConfig.shrink_min_tokens), so finished sequences stop costing compute.

Shape legend: B slots (the batch size the steps run at).
"""

from __future__ import annotations

import torch

__all__ = ["BatchSlots", "bucket", "compaction"]


def bucket(n: int) -> int:
    """The power of two a static batch of n prompts runs at: the static / captured steps of a batch of 5 are
    the batch of 8's."""
    return 1 << (n - 1).bit_length()


class BatchSlots:
    """`rows[slot]`: the prompt a slot decodes; `active[slot]`: whether it is still running (a finished or
    padding slot is frozen: it commits nothing and its output is ignored)."""

    def __init__(self, active: list[bool], device: torch.device):
        self.rows = list(range(len(active)))
        self.active = list(active)
        self.device = device
        self._masks: dict[tuple[bool, ...], torch.Tensor] = {}

    def running(self) -> list[tuple[int, int]]:
        """(slot, row) of every running slot."""
        return [(slot, self.rows[slot]) for slot, on in enumerate(self.active) if on]

    def mask(self) -> torch.Tensor:
        """`active` as a device bool tensor [B], copied once per pattern (slots finish rarely)."""
        key = tuple(self.active)
        if key not in self._masks:
            self._masks[key] = torch.tensor(self.active, device=self.device)
        return self._masks[key]

    def shrink_due(self) -> bool:
        """Whether at most half the slots still run (and some do): `shrink` would move to a smaller bucket."""
        running = sum(self.active)
        return len(self.active) > 1 and 0 < 2 * running <= len(self.active)

    def shrink(self) -> list[int] | None:
        """When at most half the slots still run: `index`, what each slot of the smaller bucket takes over (the
        running slots in order, then padding slots that keep what they hold, frozen), else None. The caller
        moves its per-slot state to match (`compaction`). Every slot that moves takes a later one, in
        increasing order, so the state can move in place, front to back."""
        if not self.shrink_due():
            return None
        keep = [slot for slot, on in enumerate(self.active) if on]
        index = keep + list(range(len(keep), bucket(len(keep))))
        self.rows = [self.rows[slot] for slot in index]
        self.active = [slot < len(keep) for slot in range(len(index))]
        self._masks = {}
        return index


def compaction(index: list[int]) -> list[tuple[int, int]]:
    """The (to, from) row moves that make rows [0, len(index)) hold what rows `index` held, in an order that is
    safe in place: a row is read before any move writes it. `index` as `BatchSlots.shrink` gives it (a row
    that moves takes a later one, in increasing order); anything else is refused."""
    moves = [(to, src) for to, src in enumerate(index) if src != to]
    sources = [src for _, src in moves]
    if any(src < to for to, src in moves) or sources != sorted(set(sources)):
        raise ValueError(f"rows {index} cannot move in place (a row may only take a later one, in order)")
    return moves
