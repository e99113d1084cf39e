"""Token counts of prepared datasets: what a reduced draft vocabulary is chosen from (longspec.drafter.vocab).

A token counts where the drafter is trained to predict it: every token of a row without a loss mask, only the
masked-in tokens (the answers) of a row with one. Shards are read whole per file, memory-mapped, so counting a
dataset costs one pass over its token files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from longspec.data.shards import ShardReader

__all__ = ["token_counts"]


def token_counts(directories: Iterable[str | os.PathLike], vocab_size: int) -> np.ndarray:
    """[V] int64 counts of the trained-on tokens over every prepared dataset in `directories`."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for directory in directories:
        reader = ShardReader(directory)
        for tokens, masks in reader.token_arrays():
            if masks is not None:
                tokens = tokens[masks.astype(bool)]
            if tokens.size and int(tokens.max()) >= vocab_size:
                raise ValueError(
                    f"{os.fspath(directory)!r} holds token id {int(tokens.max())}, outside the target's vocabulary "
                    f"of {vocab_size}: it was prepared with another tokenizer"
                )
            counts += np.bincount(tokens, minlength=vocab_size)
    return counts
