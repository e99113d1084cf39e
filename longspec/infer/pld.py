"""Prompt-lookup decoding (PLD) drafts: continue the latest earlier occurrence of the context's last n-gram.

Draft tokens are a deterministic function of the context, so verifying them as a chain with the same acceptance
rules as the tree keeps PLD lossless at any temperature (at T > 0 the deterministic-candidate rule: a lookup has
no draft distribution q).

`prompt_lookups` is the plain reference (one context, host slicing; its first draft is PLD's);
the engine runs `device_lookup`: the same drafts for a batch of rows of different lengths, read from the device
token history (`history.TokenHistory`), with fixed shapes and no host value read, so it runs inside a static /
captured step and a round that drafts by lookup launches without a host sync (the method "pld", and tree="auto"'s
lookups). `LookupShadow` makes the same lookup on the host, from the tokens the rounds bring there anyway, to
tell tree="auto"'s policy what a lookup would have accepted at the rounds that ran none.

Besides PLD's one chain, tree="auto" verifies lookup forests (`tree.Lookup` with branches > 1): the drafts of
several earlier occurrences side by side, as one tree. Where a text repeats itself with variations (code, a
summary quoting its document), the latest occurrence is often not the one the target continues: replayed over the
SmolLM2 GPU evaluation's outputs at T = 0 (`benchmarks/policy_replay.py --fixed`), a lookup every round emits 3.06
tokens a round with one chain of 16, 3.44 with two, 3.71 with four (docs/BENCHMARKS.md). A forest is verified like
a chain (`DraftTree.branches`): its visibility is known from the shape, so the cache attention's causal tail
serves it. Whether the extra tokens pay for the wider verify is the policy's call, at measured round costs.
"""

from __future__ import annotations

import torch

from longspec.infer.tree import DraftTree, Lookup

__all__ = ["LookupShadow", "device_lookup", "lookup_tree", "prompt_lookups"]


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
    ends = torch.arange(slots + 1, device=device)
    for n in range(min_ngram, max_ngram + 1):
        pattern = context.gather(1, (last - n + 1 + torch.arange(n, device=device)).clamp(min=0))
        # [B, S - n + 1]: window s = [s, s + n) against the suffix, placed at its end s + n
        match = (context.unfold(1, n, 1) == pattern[:, None, :]).all(dim=2)
        match = torch.nn.functional.pad(match, (n, 0))  # [B, S + 1], index = the window's end
        # A window must end before the root (end <= L - 1 = last): earlier occurrences only, never the suffix
        # itself, and nothing stale; and the suffix needs n tokens (n <= last, as the reference's range).
        match &= (ends <= last) & (n <= last)
        score = torch.where(match, n * (slots + 1) + ends, score)  # n increasing: a longer match wins its end
    # The best `branches` scores, best first: repeated max (scores >= 0 are unique, -1 is none). One reduction
    # for PLD's single chain, as before forests; torch.topk on these int64 scores cost a radix select's ~30
    # launches per round.
    picks = []
    for i in range(branches):
        top = score.amax(dim=1)  # [B]
        picks.append(top)
        if i + 1 < branches:
            score = torch.where(score == top[:, None], -1, score)
    top = torch.stack(picks, dim=1)  # [B, branches]
    best = torch.where(top >= 0, top % (slots + 1), -1)
    follow = (best[..., None] + torch.arange(num_draft, device=device)).clamp(0, slots - 1)
    drafts = context.gather(1, follow.flatten(1)).view(batch, branches, num_draft)
    num_valid = torch.where(best >= 0, (last + 1 - best).clamp(max=num_draft), 0)
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
    branch = ((torch.arange(tokens.shape[1], device=tokens.device) - 1) % lookup.branches).expand_as(tokens)
    valid = depths <= num_valid.gather(1, branch)
    return DraftTree(tokens, parents, depths, ancestor_mask, valid, chain=True, branches=lookup.branches)


class LookupShadow:
    """What a lookup would have accepted at the roots of the rounds that ran none, for tree="auto"'s policy: one
    row's context mirrored on the host from the tokens each round brings there anyway (no device work).

    The policy learns a lookup's acceptance from the rounds that run one; a policy in a plain streak (or running the
    drafter's trees) ran none and would learn nothing until an exploration, 16-64 plain rounds away
    (`policy.AdaptivePolicy.choose`). The shadow makes the lookup at every such root too (`prompt_lookups`'
    semantics, `branches` drafts of `length`: an incremental index of each n-gram's occurrences, so a round costs a
    few dict and list operations, not a scan of the context) and compares the drafts with the tokens that follow
    them once they are known: each branch's longest common prefix is exactly what its chain would have accepted at
    T = 0 (the forest accepts the longest of them), and has its distribution at T > 0 (the deterministic-candidate
    rule accepts a draft with the target's probability of it: that of the sample matching it)."""

    def __init__(self, prompt: list[int], length: int, max_ngram: int, branches: int = 1):
        self.length, self.max_ngram, self.branches = length, max_ngram, branches
        self.context = list(prompt)
        # n-gram -> the positions after its occurrences, ascending, for n-grams that end before the last token
        # (the reference's windows: earlier occurrences only). Built for the prompt in one pass per n rather than
        # by `_append` a token at a time: the prompt can be 128K tokens per row, and this runs before the first
        # round.
        self.index: dict[tuple[int, ...], list[int]] = {}
        size = len(self.context)
        for n in range(1, min(max_ngram, size - 1) + 1):  # windows [s, s + n), s + n <= size - 1
            grams = zip(*(self.context[i : size - n + i] for i in range(n)), strict=True)
            for gram, end in zip(grams, range(n, size), strict=True):
                self.index.setdefault(gram, []).append(end)
        # [drafts, tokens matched so far, live branches]: resolved by the tokens that follow its root
        self.pending: list[list] = []

    def draft(self) -> list[list[int]]:
        """`prompt_lookups(context, length, max_ngram, branches)` from the index (lists of tokens)."""
        context, size = self.context, len(self.context)
        ends: list[int] = []
        for n in range(min(self.max_ngram, size - 1), 0, -1):
            # latest first; an end already taken matched a longer n-gram too (and ranks there)
            for end in reversed(self.index.get(tuple(context[size - n :]), ())):
                if len(ends) == self.branches:
                    break
                if end not in ends:
                    ends.append(end)
        return [context[end : end + self.length] for end in ends]

    def extend(self, tokens: list[int], *, shadow: bool) -> list[list[int]]:
        """A settled round's emitted tokens (its root is the context's last token); `shadow`: the round ran no
        lookup, so the lookup at its root is tracked, unless an earlier root's is still matching (the root lies
        inside the run that lookup would have accepted: one report per lookup round that could have run). Returns,
        for each shadow lookup this round's tokens resolved (every branch mismatched or matched whole), the drafts
        each of its branches matched ([] for no match)."""
        resolved = []
        # A shadow lookup still matching covers this root: a lookup round there would still be emitting its drafts,
        # and the next one starts after them. Reporting every root of a matched run instead counted a run of k
        # drafts k times (k, k - 1, ..., 1): in a GPU sample at T = 1 one run of 9 quoted tokens, decoded plain,
        # reported 45 drafts, and the sample's lookup16x2 rounds then accepted 0.21 a round (docs/BENCHMARKS.md).
        if shadow and not self.pending:
            drafts = self.draft()
            if drafts:
                self.pending.append([drafts, [0] * len(drafts), set(range(len(drafts)))])
            else:
                resolved.append([])  # no match: the lookup accepts nothing
        for token in tokens:
            self._append(token)
            still = []
            for entry in self.pending:  # each live branch compares its next draft token with this one
                drafts, matched, live = entry
                for i in list(live):
                    if token == drafts[i][matched[i]]:
                        matched[i] += 1
                        if matched[i] < len(drafts[i]):
                            continue
                    live.discard(i)
                if live:
                    still.append(entry)
                else:
                    resolved.append(matched)
            self.pending = still
        return resolved

    def _append(self, token: int) -> None:
        context, size = self.context, len(self.context)
        for n in range(1, min(self.max_ngram, size) + 1):  # n-grams ending at the old last token: earlier now
            self.index.setdefault(tuple(context[size - n :]), []).append(size)
        context.append(token)
