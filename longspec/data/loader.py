"""Deterministic batches from a ShardReader: which rows a (step, micro-step, rank) trains on, and their collation.

The data position is just the global optimizer step: rows of step s are a slice of a permutation seeded by
(seed, epoch), so resuming at step s needs no iterator state and reproduces an uninterrupted run exactly.
Within a step the global batch is laid out micro-step-major: micro-step m of rank r takes rows
[(m * world + r) * micro, (m * world + r + 1) * micro) of the step's slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from longspec.data.shards import ShardReader

__all__ = ["IGNORE_INDEX", "Batch", "StepSampler", "collate_rows"]

IGNORE_INDEX = -100


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B,T] long, right-padded with the pad id
    labels: torch.Tensor  # [B,T] long: the token after t, or IGNORE_INDEX where nothing is trained
    num_tokens: int  # real (unpadded) tokens in the batch

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.input_ids.to(device, non_blocking=True),
            self.labels.to(device, non_blocking=True),
            self.num_tokens,
        )


def collate_rows(
    rows: list[tuple[np.ndarray, np.ndarray | None]], *, pad_id: int, pad_to_multiple: int = 1
) -> Batch:
    """Rows of (tokens [L], loss mask [L] | None) -> next-token Batch. Without a mask every next token is trained
    on; with one, only tokens whose mask is set (the SFT response). Right padding is harmless under causal
    attention: padded positions come after every real token and carry IGNORE_INDEX labels."""
    length = max(tokens.size for tokens, _ in rows)
    length = -(-length // pad_to_multiple) * pad_to_multiple
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for b, (tokens, mask) in enumerate(rows):
        ids = torch.from_numpy(tokens)
        input_ids[b, : ids.numel()] = ids
        targets = ids[1:].clone()
        if mask is not None:
            targets[~torch.from_numpy(mask[1:])] = IGNORE_INDEX
        labels[b, : targets.numel()] = targets
    return Batch(input_ids=input_ids, labels=labels, num_tokens=sum(tokens.size for tokens, _ in rows))


class StepSampler:
    """Maps (global step, micro-step, rank) to dataset rows; one epoch = len(dataset) // global_batch_size steps
    (the ragged tail of each epoch's permutation is skipped)."""

    def __init__(
        self,
        reader: ShardReader,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
    ):
        if global_batch_size % (micro_batch_size * world_size):
            raise ValueError(
                f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size {micro_batch_size} x "
                f"world size {world_size}"
            )
        if len(reader) < global_batch_size:
            raise ValueError(
                f"the prepared data has {len(reader)} rows, fewer than one global batch ({global_batch_size}); "
                "prepare more data or lower stage.global_batch_size"
            )
        self.reader = reader
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.world_size = world_size
        self.grad_accum = global_batch_size // (micro_batch_size * world_size)
        self.seed = seed
        self.shuffle = shuffle
        self.steps_per_epoch = len(reader) // global_batch_size
        self._epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            if self.shuffle:
                # A generator of its own, seeded by (seed, epoch): the global RNG streams stay untouched.
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.reader))
            else:
                self._perm = np.arange(len(self.reader))
            self._epoch = epoch
        return self._perm

    def rows(self, step: int, micro_step: int, rank: int) -> np.ndarray:
        """Row indices of one micro-batch (0-based global `step`)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        start = (
            within * self.global_batch_size + (micro_step * self.world_size + rank) * self.micro_batch_size
        )
        return self._permutation(epoch)[start : start + self.micro_batch_size]

    def micro_batches(self, step: int, rank: int, *, pad_id: int, pad_to_multiple: int = 1) -> list[Batch]:
        """All `grad_accum` micro-batches rank `rank` trains on at `step`."""
        return [
            collate_rows(
                [self.reader.row(int(i)) for i in self.rows(step, m, rank)],
                pad_id=pad_id,
                pad_to_multiple=pad_to_multiple,
            )
            for m in range(self.grad_accum)
        ]
