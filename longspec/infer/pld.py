"""Prompt-lookup decoding (PLD) drafts: continue the latest earlier occurrence of the context's last n-gram.

Draft tokens are a deterministic function of the context, so verifying them as a chain with the same acceptance
rules as the tree keeps PLD lossless at any temperature (at T > 0 the deterministic-candidate rule: a lookup has
no draft distribution q).

`prompt_lookups` is the plain reference (one context, host slicing; its first draft is PLD's);
the engine runs `device_lookup`: the same drafts for a batch of rows of different lengths, read from the device
token history (`history.TokenHistory`), with fixed shapes and no host value read, so it runs inside a static /
captured step and a round that drafts by lookup launches without a host sync (the method "pld", and tree="auto"'s
lookups). `LookupShadow` makes the same lookup on the host, from the tokens the rounds bring there anyway, to
tell tree="auto"'s policy what a lookup would have accepted at the rounds that ran none: as the run happens (each
round that matched more of its drafts reports them, the depths past them still unknown: right-censored) and once
more when the text has resolved it (`ShadowReport`); a round that runs a lookup itself ends the shadow.

Besides PLD's one chain, tree="auto" verifies lookup forests (`tree.Lookup` with branches > 1): the drafts of
several earlier occurrences side by side, as one tree. Where a text repeats itself with variations (code, a
summary quoting its document), the latest occurrence is often not the one the target continues: replayed over the
SmolLM2 GPU evaluation's outputs at T = 0 (`benchmarks/policy_replay.py --fixed`), a lookup every round emits 3.06
tokens a round with one chain of 16, 3.44 with two, 3.71 with four (docs/BENCHMARKS.md). A forest is verified like
a chain (`DraftTree.branches`): its visibility is known from the shape, so the cache attention's causal tail
serves it. Whether the extra tokens pay for the wider verify is the policy's call, at measured round costs.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

from longspec.infer.tree import DraftTree, Lookup
from longspec.modules.constants import arange_once

__all__ = ["LookupShadow", "ShadowReport", "device_lookup", "lookup_tree", "prompt_lookups"]


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


class ShadowReport(NamedTuple):
    """What `LookupShadow` tells of one shadow lookup: `matched`, per branch (best first), the drafts it has matched
    so far (() where nothing was there to draft); `reported`, the most any branch had matched at this lookup's
    earlier reports (0: its first report), so a report's new drafts are max(matched) - reported and an outcome
    heard in pieces counts once; `done`, whether the text has resolved it (every branch mismatched or matched
    whole). An open report is right-censored: the drafts past max(matched) are not decided yet. The defaults make
    a lookup's whole outcome in one report."""

    matched: tuple[int, ...]
    reported: int = 0
    done: bool = True


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
    rule accepts a draft with the target's probability of it: that of the sample matching it).

    It reports while the run happens (`extend`): heard only once the text had resolved it, a quote decoded plain
    reached the policy when the quote was over, the lookups' estimate rose just as the run they would have paid on
    ended, and lookup rounds then missed in streaks of 5-8 (GPU round logs at T = 1); a replay that heard each
    outcome at its root was 1-3% faster (docs/BENCHMARKS.md, "The shadow is heard only when its run ends")."""

    def __init__(self, prompt: list[int], length: int, max_ngram: int, branches: int = 1):
        self.length, self.max_ngram, self.branches = length, max_ngram, branches
        self.context = list(prompt)
        # The prompt's n-grams that end before its last token (the reference's windows: earlier occurrences only),
        # per n sorted by value (`_PromptGrams`): built with a few array operations, since the prompt can be 128K
        # tokens per row and this runs before the first round, in the call's prefill time (a dict of every n-gram,
        # as before: 6.5 ms for 8K tokens, 395 ms for 128K on a CI core; these tables 1.6 / 37 ms; a round's draft
        # costs ~10 us more: benchmarks/shadow_index.py, docs/BENCHMARKS.md). Those ending later, the generated text's, go into `index` as they
        # come (`_append`): n-gram -> the positions after its occurrences, ascending.
        self.prompt_grams = _PromptGrams(self.context, max_ngram)
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.pending: _ShadowRun | None = None  # the shadow lookup the tokens that follow its root resolve

    def draft(self) -> list[list[int]]:
        """`prompt_lookups(context, length, max_ngram, branches)` from the indexes (lists of tokens)."""
        context, size = self.context, len(self.context)
        ends: list[int] = []
        for n in range(min(self.max_ngram, size - 1), 0, -1):
            gram = tuple(context[size - n :])
            # latest first (the generated text's occurrences, then the prompt's); an end already taken matched a
            # longer n-gram too (and ranks there)
            later = reversed(self.index.get(gram, ()))
            # at most `branches` ends taken already, so 2 x branches of the prompt's suffice
            for end in itertools.chain(later, self.prompt_grams.ends(gram, 2 * self.branches)):
                if len(ends) == self.branches:
                    break
                if end not in ends:
                    ends.append(end)
        return [context[end : end + self.length] for end in ends]

    def extend(self, tokens: list[int], *, shadow: bool) -> list[ShadowReport]:
        """A settled round's emitted tokens (its root is the context's last token); `shadow`: the round ran no
        lookup, so the lookup at its root is tracked, unless an earlier root's is still matching (the root lies
        inside the run that lookup would have accepted: one report stream per lookup round that could have run).
        Returns the shadow lookup's reports: an open one where these tokens matched more of its drafts, a closed
        one where they resolved it (every branch mismatched or matched whole; a lookup with nothing to draft at
        once), at most one of either per call."""
        reports = []
        if not shadow:
            # The round's own outcome covers its tokens from here on: a shadow continued over them counted them
            # twice, once as the lookup round's accepts and again as the shadow's. Its open reports stand, censored
            # where it was dropped.
            self.pending = None
        elif self.pending is None:
            # A shadow lookup still matching covers this root: a lookup round there would still be emitting its
            # drafts, and the next one starts after them. Reporting every root of a matched run instead counted a
            # run of k drafts k times (k, k - 1, ..., 1): in a GPU sample at T = 1 one run of 9 quoted tokens,
            # decoded plain, reported 45 drafts, and the sample's lookup16x2 rounds then accepted 0.21 a round
            # (docs/BENCHMARKS.md).
            drafts = self.draft()
            if drafts:
                self.pending = _ShadowRun(drafts)
            else:
                reports.append(ShadowReport(()))  # no match: the lookup accepts nothing
        for token in tokens:
            self._append(token)
            if self.pending is not None and self.pending.step(token):
                reports.append(self.pending.report(done=True))
                self.pending = None
        if self.pending is not None and self.pending.best > self.pending.reported:
            reports.append(self.pending.report(done=False))
        return reports

    def _append(self, token: int) -> None:
        """The n-grams ending at the current last token become earlier occurrences (`index`), then `token` joins
        the context."""
        context, size = self.context, len(self.context)
        for n in range(1, min(self.max_ngram, size) + 1):  # n-grams ending at the old last token: earlier now
            self.index.setdefault(tuple(context[size - n :]), []).append(size)
        context.append(token)


class _PromptGrams:
    """A prompt's n-grams (n = 1 .. max_ngram) that end before its last token, each n's as one array of keys sorted
    next to the positions after the occurrences: an n-gram's occurrences are one binary search away, in position
    order. A key is a polynomial hash of the n-gram (uint64, wrapping), so equal keys are checked against the
    tokens (`ends`): any vocabulary, any n."""

    # odd (a bijection mod 2**64 per step); a collision is told apart in `ends`
    MULTIPLIER = 0x9E3779B97F4A7C15

    def __init__(self, prompt: list[int], max_ngram: int):
        self.tokens = np.asarray(prompt, dtype=np.uint64)
        size = self.tokens.size
        self.tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        with np.errstate(over="ignore"):
            for n in range(1, min(max_ngram, size - 1) + 1):  # windows [s, s + n), s + n <= size - 1
                keys = np.zeros(size - n, dtype=np.uint64)
                for i in range(n):
                    keys = keys * np.uint64(self.MULTIPLIER) + self.tokens[i : size - n + i]
                order = np.argsort(keys, kind="stable")  # equal keys stay in position order
                self.tables[n] = (keys[order], order + n)  # the position after each occurrence

    def ends(self, gram: tuple[int, ...], limit: int) -> list[int]:
        """Up to `limit` positions after `gram`'s occurrences in the prompt, latest first."""
        table = self.tables.get(len(gram))
        if table is None:
            return []
        keys, ends = table
        key = 0
        for token in gram:
            key = (key * self.MULTIPLIER + token) % (1 << 64)
        # the last entry with this key, then back through the equal ones: latest first
        found, n, gram = [], len(gram), list(gram)
        index = int(np.searchsorted(keys, np.uint64(key), "right")) - 1
        while index >= 0 and len(found) < limit and int(keys[index]) == key:
            end = int(ends[index])
            if (
                self.tokens[end - n : end].tolist() == gram
            ):  # a key shared by another n-gram is told apart here
                found.append(end)
            index -= 1
        return found


class _ShadowRun:
    """A shadow lookup the text has not resolved yet: its drafts, what each branch matched so far, the branches
    still matching, and how many drafts its reports have given."""

    def __init__(self, drafts: list[list[int]]):
        self.drafts = drafts
        self.matched = [0] * len(drafts)
        self.live = set(range(len(drafts)))
        self.reported = 0

    @property
    def best(self) -> int:
        return max(self.matched)

    def step(self, token: int) -> bool:
        """The token after the drafts matched so far: each live branch compares its next draft with it. Returns
        whether that resolved the lookup."""
        for i in list(self.live):
            if token == self.drafts[i][self.matched[i]]:
                self.matched[i] += 1
                if self.matched[i] < len(self.drafts[i]):
                    continue
            self.live.discard(i)
        return not self.live

    def report(self, *, done: bool) -> ShadowReport:
        report = ShadowReport(tuple(self.matched), self.reported, done)
        self.reported = self.best
        return report
