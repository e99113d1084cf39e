"""Prompt-lookup decoding (PLD) drafts: continue the latest earlier occurrence of the context's last n-gram.

Draft tokens are a deterministic function of the context, so verifying them as a chain with the same acceptance
rules as the tree keeps PLD lossless at any temperature (at T > 0 the deterministic-candidate rule: a lookup has
no draft distribution q).

`prompt_lookups` is the plain reference (one context, host slicing; its first draft is PLD's);
the engine runs `device_lookup`: the same drafts for a batch of rows of different lengths, read from the device
token history (`history.TokenHistory`), with fixed shapes and no host value read, so it runs inside a static /
captured step and a round that drafts by lookup launches without a host sync (the method "pld", and tree="auto"'s
lookups). Besides PLD's one chain, tree="auto" verifies lookup forests (`candidates.Lookup` with branches > 1): the drafts
of several earlier occurrences side by side, as one tree, for a text that repeats itself with variations. A
forest is verified like a chain (`DraftTree.branches`): its visibility is known from the shape, so the cache
attention's causal tail serves it.
"""

from __future__ import annotations

import torch

from longspec.infer.candidates import Lookup
from longspec.infer.tree import DraftTree
from longspec.modules.constants import arange_once

__all__ = ["device_lookup", "lookup_tree", "prompt_lookups"]


def prompt_lookups(
    context: torch.Tensor, num_draft: int, max_ngram: int, branches: int = 1, min_ngram: int = 1
) -> list[torch.Tensor]:
    """context [L] long (prompt + emitted tokens, the last one being the current root) -> up to `branches`
    drafts [<= num_draft], best first.

    An earlier position e of the context (e < L - 1) is a match of size n when the n tokens ending at e - 1 are
    the context's last n (n = max_ngram .. min_ngram; the suffix itself does not count); a match proposes the
    tokens from e on. Matches rank by their longest size, then latest first: the first draft is PLD's (the most
    recent occurrence of the longest n-gram that occurs), the others continue older or shorter occurrences,
    each from another position (their texts may agree: a tree verifies both, the deepest accepted path wins).
    Empty when nothing matches."""
    length = context.numel()
    best: dict[int, int] = {}  # match end e -> its longest size n
    for n in range(min_ngram, min(max_ngram, length - 1) + 1):
        pattern = context[length - n :]
        windows = context[: length - 1].unfold(0, n, 1)  # [L - n, n]: every earlier n-gram, except the suffix
        for s in torch.nonzero((windows == pattern).all(dim=1), as_tuple=False).flatten().tolist():
            best[s + n] = n  # host sync: the reference picks on the host
    ends = sorted(best, key=lambda e: (best[e], e), reverse=True)[:branches]
    return [context[e : e + num_draft] for e in ends]


def device_lookup(
    history: torch.Tensor,
    lengths: torch.Tensor,
    roots: torch.Tensor,
    num_draft: int,
    max_ngram: int,
    min_ngram: int = 1,
    branches: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`prompt_lookups` for a batch, on the device with fixed shapes: row b's context is history[b, :n_b] (its
    committed tokens, n_b = lengths[b]) followed by roots[b] (the last token emitted, at position n_b, not yet
    committed); history positions >= n_b are stale and never read as context. Returns (drafts [B, branches,
    num_draft], num_valid [B, branches]): row b's draft i is drafts[b, i, :num_valid[b, i]] (0 when there is no
    i-th match; fewer than num_draft when the match continues into the context's end).

    Every n-gram size is matched over every window of the history's slots ([B, S - n + 1] compares per size,
    whatever the rows' lengths: the shapes stay those of the history); each match end gets the score
    n * (S + 1) + end of its longest size, and the `branches` best scores win: the reference's order. Requires
    n_b < S (the cache's slack always leaves room for the root)."""
    batch, slots = history.shape
    device = history.device
    # The context with the root in its place, out of place: the history itself is only written by commits.
    context = history.scatter(1, lengths[:, None], roots[:, None])  # [B, S]
    last = lengths[:, None]  # the root's position: L - 1 in the reference's terms
    score = torch.full((batch, slots + 1), -1, dtype=torch.long, device=device)  # by match end, -1: none
    ends = arange_once(slots + 1, device)
    for n in range(min_ngram, max_ngram + 1):
        pattern = context.gather(1, (last - n + 1 + arange_once(n, device)).clamp(min=0))
        # [B, S - n + 1]: window s = [s, s + n) against the suffix, placed at its end s + n
        match = (context.unfold(1, n, 1) == pattern[:, None, :]).all(dim=2)
        match = torch.nn.functional.pad(match, (n, 0))  # [B, S + 1], index = the window's end
        # A window must end before the root (end <= L - 1 = last): earlier occurrences only, never the suffix
        # itself, and nothing stale; and the suffix needs n tokens (n <= last, as the reference's range).
        match &= (ends <= last) & (n <= last)
        score = torch.where(match, n * (slots + 1) + ends, score)  # n increasing: a longer match wins its end
    # The best `branches` scores, best first: repeated max (scores >= 0 are unique, -1 is none). One reduction
    # for PLD's single chain, as before forests; torch.topk on these int64 scores cost a radix select's ~30
    # launches per round. (The fills below are masked_fill's, not where's: on CUDA a where's scalar operand is a
    # tensor made on the device first, one more launch each.)
    picks = []
    for i in range(branches):
        top = score.amax(dim=1)  # [B]
        picks.append(top)
        if i + 1 < branches:
            score = score.masked_fill(score == top[:, None], -1)
    top = torch.stack(picks, dim=1)  # [B, branches]
    none = top < 0
    best = (top % (slots + 1)).masked_fill_(none, -1)
    follow = (best[..., None] + arange_once(num_draft, device)).clamp(0, slots - 1)
    drafts = context.gather(1, follow.flatten(1)).view(batch, branches, num_draft)
    num_valid = (last + 1 - best).clamp(max=num_draft).masked_fill_(none, 0)
    return drafts, num_valid


def lookup_tree(
    history: torch.Tensor,
    lengths: torch.Tensor,
    roots: torch.Tensor,
    lookup: Lookup,
    max_ngram: int,
    parts: tuple[torch.Tensor, ...],
) -> DraftTree:
    """The round's lookup drafts as a forest [B, 1 + length x branches] from `roots` (`device_lookup`, stored
    level by level: `tree.forest_parts`, whose constant parts (parents, depths, ancestor_mask) are `parts`, made
    once per shape so a round builds none of them): padding past a branch's drafts is invalid, never accepted
    (chain i's node at depth d is valid iff d <= its drafts)."""
    parents, depths, ancestor_mask = parts
    drafts, num_valid = device_lookup(
        history, lengths, roots, lookup.length, max_ngram, branches=lookup.branches
    )
    tokens = torch.cat([roots[:, None], drafts.transpose(1, 2).flatten(1)], dim=1)  # level by level
    # each node's chain (the root's: any, its depth 0 is always valid)
    branch = ((arange_once(tokens.shape[1], tokens.device) - 1) % lookup.branches).expand_as(tokens)
    valid = depths <= num_valid.gather(1, branch)
    return DraftTree(tokens, parents, depths, ancestor_mask, valid, chain=True, branches=lookup.branches)
