"""Prompt-lookup decoding (PLD) drafts: continue the latest earlier occurrence of the context's last n-gram.

Draft tokens are a deterministic function of the context, so verifying them as a chain with the same acceptance
rules as the tree keeps PLD lossless at any temperature.
"""

from __future__ import annotations

import torch

__all__ = ["prompt_lookup"]


def prompt_lookup(context: torch.Tensor, num_draft: int, max_ngram: int, min_ngram: int = 1) -> torch.Tensor:
    """context [L] long (prompt + emitted tokens, the last one being the current root) -> draft [<= num_draft].

    Tries n = max_ngram .. min_ngram: finds the most recent earlier position where context[-n:] occurs and
    proposes the tokens that followed it. Empty when nothing matches."""
    length = context.numel()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = context[length - n :]
        windows = context[: length - 1].unfold(0, n, 1)  # [L - n, n]: every earlier n-gram, except the suffix
        hits = torch.nonzero((windows == pattern).all(dim=1), as_tuple=False).flatten()
        if hits.numel():
            start = int(hits[-1]) + n  # host sync: picks the slice
            return context[start : start + num_draft]
    return context.new_empty(0)
