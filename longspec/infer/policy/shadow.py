"""Shadow lookups: what a prompt-lookup chain would have accepted at the roots of the rounds that ran none, made
on the host from the tokens each round brings there anyway, for tree="auto"'s policy. Reported as the run happens
(each round that matched more drafts reports them, the depths past them still unknown: right-censored) and once
more when the text has resolved it (`ShadowReport`); a round that runs a lookup itself ends the shadow.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

__all__ = ["LookupShadow", "ShadowReport"]


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

    The shadow makes the lookup at every root of a round that ran none (`pld.prompt_lookups`' semantics, `branches`
    drafts of `length`, from an incremental index of each n-gram's occurrences) and compares the drafts with the
    tokens that follow them once they are known: each branch's longest common prefix is exactly what its chain
    would have accepted at T = 0, and has its distribution at T > 0 (the deterministic-candidate rule). It reports
    while the run happens (`extend`), so a quote decoded plain raises the lookups' estimate while it goes on."""

    def __init__(self, prompt: list[int], length: int, max_ngram: int, branches: int = 1):
        self.length, self.max_ngram, self.branches = length, max_ngram, branches
        self.context = list(prompt)
        # The prompt's n-grams that end before its last token (earlier occurrences only), per n sorted by value
        # (`_PromptGrams`, a few array operations: the prompt may be long and this runs in the call's prefill);
        # those ending later, the generated text's, go into `index` as they
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
            # drafts, and the next one starts after them (one report stream per lookup round that could have run,
            # so a run of k drafts is not counted k times).
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
