"""Prompt-lookup decoding (PLD) drafts: continue the latest earlier occurrence of the context's last n-gram.

Draft tokens are a deterministic function of the context, so verifying them as a chain with the same acceptance
rules as the tree keeps PLD lossless at any temperature (at T > 0 the deterministic-candidate rule: a lookup has
no draft distribution q).

`prompt_lookup` is the plain reference (one context, host slicing); the engine runs `device_lookup`: the same
drafts for a batch of rows of different lengths, read from the device token history (`history.TokenHistory`),
with fixed shapes and no host value read, so it runs inside a static / captured step and a round that drafts by
lookup launches without a host sync (the method "pld", and tree="auto"'s lookup chains). `LookupShadow` makes the
same lookup on the host, from the tokens the rounds bring there anyway, to tell tree="auto"'s policy what a lookup
would have accepted at the rounds that ran none.
"""

from __future__ import annotations

import torch

from longspec.infer.tree import DraftTree

__all__ = ["LookupShadow", "device_lookup", "lookup_tree", "prompt_lookup"]


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


def device_lookup(
    history: torch.Tensor,
    lengths: torch.Tensor,
    roots: torch.Tensor,
    num_draft: int,
    max_ngram: int,
    min_ngram: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`prompt_lookup` for a batch, on the device with fixed shapes: row b's context is history[b, :n_b] (its
    committed tokens, n_b = lengths[b]) followed by roots[b] (the last token emitted, at position n_b, not yet
    committed); history positions >= n_b are stale and never read as context. Returns (drafts [B, num_draft],
    num_valid [B]): row b's draft is drafts[b, :num_valid[b]] (0 when nothing matches; fewer than num_draft
    when the match continues into the context's end).

    Every n-gram size is matched over every window of the history's slots ([B, S - n + 1] compares per size,
    whatever the rows' lengths: the shapes stay those of the history) and the latest match of the longest size
    wins: the reference's order. Requires n_b < S (the cache's slack always leaves room for the root)."""
    slots = history.shape[1]
    # The context with the root in its place, out of place: the history itself is only written by commits.
    context = history.scatter(1, lengths[:, None], roots[:, None])  # [B, S]
    last = lengths[:, None]  # the root's position: L - 1 in the reference's terms
    best = torch.full_like(lengths, -1)  # the winning window's end (its last position + 1), -1: none
    # n increasing: a longer n-gram's match overwrites a shorter one's
    for n in range(min_ngram, max_ngram + 1):
        pattern = context.gather(1, (last - n + 1 + torch.arange(n, device=history.device)).clamp(min=0))
        # [B, S - n + 1]: window s = [s, s + n) against the suffix
        match = (context.unfold(1, n, 1) == pattern[:, None, :]).all(dim=2)
        starts = torch.arange(match.shape[1], device=history.device)
        # A window must end before the root (s + n <= L - 1 = last): earlier occurrences only, never the suffix
        # itself, and nothing stale; and the suffix needs n tokens (n <= last, as the reference's range).
        match &= (starts + n <= last) & (n <= last)
        latest = torch.where(match, starts, -1).amax(dim=1)  # [B]
        best = torch.where(latest >= 0, latest + n, best)
    found = best >= 0
    follow = (best[:, None] + torch.arange(num_draft, device=history.device)).clamp(0, slots - 1)
    drafts = context.gather(1, follow)
    num_valid = torch.where(found, (last[:, 0] + 1 - best).clamp(max=num_draft), 0)
    return drafts, num_valid


def lookup_tree(
    history: torch.Tensor,
    lengths: torch.Tensor,
    roots: torch.Tensor,
    num_draft: int,
    max_ngram: int,
    chain: tuple[torch.Tensor, ...],
) -> DraftTree:
    """The round's lookup drafts as a chain tree [B, 1 + num_draft] from `roots` (`device_lookup`): padding
    past a row's drafts is invalid, never accepted (node d, at depth d, is valid iff d <= the row's drafts).
    `chain`: the chain's constant parts (parents, depths, ancestor_mask) made once per shape, so a round builds
    none of them."""
    parents, depths, ancestor_mask = chain
    drafts, num_valid = device_lookup(history, lengths, roots, num_draft, max_ngram)
    tokens = torch.cat([roots[:, None], drafts], dim=1)
    return DraftTree(tokens, parents, depths, ancestor_mask, depths <= num_valid[:, None], chain=True)


class LookupShadow:
    """What a lookup chain would have accepted at the roots of the rounds that ran none, for tree="auto"'s policy:
    one row's context mirrored on the host from the tokens each round brings there anyway (no device work).

    The policy learns a lookup's acceptance from the rounds that run one; a policy in a plain streak (or running the
    drafter's trees) ran none and would learn nothing until an exploration, 16-64 plain rounds away
    (`policy.AdaptivePolicy.choose`). The shadow makes the lookup at
    every such root too (`prompt_lookup`'s semantics: an incremental index of each n-gram's latest occurrence, so a
    round costs a few dict operations, not a scan of the context) and compares the draft with the tokens that
    follow it once they are known: the longest common prefix is exactly what the chain would have accepted at
    T = 0, and has its distribution at T > 0 (the deterministic-candidate rule accepts a draft with the target's
    probability of it: that of the sample matching it)."""

    def __init__(self, prompt: list[int], length: int, max_ngram: int):
        self.length, self.max_ngram = length, max_ngram
        self.context = list(prompt)
        # n-gram -> the position after its latest occurrence, for n-grams that end before the last token (the
        # reference's windows: earlier occurrences only). Built for the prompt in one pass per n rather than by
        # `_append` a token at a time: the prompt can be 128K tokens per row, and this runs before the first round.
        self.index: dict[tuple[int, ...], int] = {}
        size = len(self.context)
        for n in range(
            1, min(max_ngram, size - 1) + 1
        ):  # windows [s, s + n), s + n <= size - 1: the latest kept
            grams = zip(*(self.context[i : size - n + i] for i in range(n)), strict=True)
            self.index.update(zip(grams, range(n, size), strict=True))
        # [draft, tokens matched so far]: resolved by the tokens that follow its root
        self.pending: list[list] = []

    def draft(self) -> list[int]:
        """`prompt_lookup(context, length, max_ngram)` from the index."""
        context, size = self.context, len(self.context)
        for n in range(min(self.max_ngram, size - 1), 0, -1):
            start = self.index.get(tuple(context[size - n :]))
            if start is not None:
                return context[start : start + self.length]
        return []

    def extend(self, tokens: list[int], *, shadow: bool) -> list[int]:
        """A settled round's emitted tokens (its root is the context's last token); `shadow`: the round ran no
        lookup, so the lookup at its root is tracked. Returns the accepted counts of the shadow chains that this
        round's tokens resolved (a mismatch, or the whole draft matched)."""
        resolved = []
        if shadow:
            draft = self.draft()
            if draft:
                self.pending.append([draft, 0])
            else:
                resolved.append(0)  # no match: the chain accepts nothing
        for token in tokens:
            self._append(token)
            still = []
            for entry in self.pending:  # each compares its next draft token with this one
                draft, matched = entry
                if token == draft[matched]:
                    entry[1] = matched = matched + 1
                    if matched < len(draft):
                        still.append(entry)
                        continue
                resolved.append(matched)
            self.pending = still
        return resolved

    def _append(self, token: int) -> None:
        context, size = self.context, len(self.context)
        for n in range(1, min(self.max_ngram, size) + 1):  # n-grams ending at the old last token: earlier now
            self.index[tuple(context[size - n :])] = size
        context.append(token)
