"""The acceptance model of tree="auto" (`AcceptanceModel`: per-depth rank hazards) and the yield calibration
(`YieldCalibration`: realised over predicted drafts) that scales it.

For the accepted path's node at depth d, its RANK among the level's candidates (its slot in the level, best
first) is observed; a level of width w accepts iff the rank is < w. The rank's distribution per depth is kept as
discrete hazards over rank buckets [0,1) [1,2) [2,4) [4,8) [8,16) [16,...), h_j = P(rank in bucket j | rank >=
bucket j's start), each a decayed success / trial count with a prior. A rejection at depth d with width w says
only "rank >= w" (censored): a miss for the buckets below w and nothing for the others, so one model serves every
candidate, including trees that are not running. Depth 1 has a fixed prior; depth d > 1 takes depth d-1's
estimate as its prior.

    expected tokens(widths) = 1 + sum_d prod_{i <= d} P(accept at depth i | accepted above, width widths[i-1])
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

__all__ = ["RANK_EDGES", "AcceptanceModel", "YieldCalibration"]

RANK_EDGES = (1, 2, 4, 8, 16)  # bucket j = ranks [RANK_EDGES[j-1], RANK_EDGES[j]) (edge -1 = 0)
# The counts are stored divided by a running scale that each decay multiplies (`_decay`), folded back into the
# counts below this scale: far from float's smallest normal, so a count of one in stored units stays finite.
_RESCALE_BELOW = 2.0**-256


class AcceptanceModel:
    """Per-depth rank hazards with a Beta prior and exponential decay (see the module docstring).

    It is observed and read every decode round (host time between two device rounds), so it does what an
    observation changed and what is read, once: the counts are stored divided by a running scale, which a decay
    multiplies instead of every count; and after an observation one pass (`_fill`) computes each rank bucket's
    hazards down to the deepest depth read of it (a lookup chain reads bucket 0 alone)."""

    def __init__(
        self,
        max_depth: int,
        *,
        decay: float = 0.97,
        prior_first: float = 0.5,
        prior_rest: float = 0.25,
        prior_weight: float = 2.0,
    ):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.prior_weight = prior_weight
        self.first_prior = [prior_first] + [prior_rest] * (len(RANK_EDGES) - 1)  # depth 1's hazards
        # The decayed counts per rank bucket, per depth (bucket by bucket, as `_fill` reads them) are these times
        # _scale (`hits`, `trials`).
        self._hits = [[0.0] * max_depth for _ in RANK_EDGES]
        self._trials = [[0.0] * max_depth for _ in RANK_EDGES]
        self._scale = 1.0
        # What is read, kept across observations: per widths, each level's last rank bucket entirely below its
        # width (`_plan`); per bucket j, the deepest depth P(rank < RANK_EDGES[j]) was read at, and how deep its
        # hazards are needed (P(rank < RANK_EDGES[j]) needs buckets 0..j: the deepest of buckets j, j + 1, ...).
        self._levels: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._asked = [0] * len(RANK_EDGES)
        self._needed = [0] * len(RANK_EDGES)
        # Valid until the next observation (`_stale`): expected tokens per widths, and per bucket j, at depths
        # 1, 2, ... as far as read (`_fill`): the hazards, and P(rank < RANK_EDGES[j]) (what accept_prob reads).
        self._expected: dict[tuple[int, ...], float] = {}
        self._hazards: list[list[float]] = [[] for _ in RANK_EDGES]
        self._accept: list[list[float]] = [[] for _ in RANK_EDGES]
        self._stale = True

    @property
    def max_depth(self) -> int:
        return len(self._hits[0])

    @property
    def hits(self) -> list[list[float]]:
        """Per depth, per rank bucket: the decayed count of rounds whose rank fell in the bucket."""
        return [[h * self._scale for h in depth] for depth in zip(*self._hits, strict=True)]

    @property
    def trials(self) -> list[list[float]]:
        """Per depth, per rank bucket: the decayed count of rounds whose rank was known to reach the bucket."""
        return [[t * self._scale for t in depth] for depth in zip(*self._trials, strict=True)]

    def hazard(self, depth: int, bucket: int) -> float:
        """P(rank in bucket | rank >= bucket start) at tree depth `depth` (1-based)."""
        self._ask(bucket, depth)
        if self._stale:
            self._fill()
        return self._hazards[bucket][depth - 1]

    def accept_prob(self, depth: int, width: int) -> float:
        """P(rank < width) at `depth`, from the buckets entirely below `width` (conservative between edges)."""
        below = bisect.bisect_right(RANK_EDGES, width)  # the buckets entirely below `width`
        if not below:
            return 0.0
        self._ask(below - 1, depth)
        if self._stale:
            self._fill()
        return self._accept[below - 1][depth - 1]

    def expected_tokens(self, widths: tuple[int, ...]) -> float:
        """Expected tokens a round of `widths` emits (accepted drafts + the bonus)."""
        expected = self._expected.get(widths)
        if expected is not None:
            return expected
        levels = self._levels.get(widths)
        if levels is None:
            levels = self._levels[widths] = self._plan(widths)
        if self._stale:
            self._fill()
        accept = self._accept
        total, reach = 1.0, 1.0
        for depth, j in enumerate(levels):
            reach *= accept[j][depth]  # accept_prob(depth + 1, widths[depth])
            total += reach
        self._expected[widths] = total
        return total

    def _plan(self, widths: tuple[int, ...]) -> tuple[int, ...]:
        """Per level of `widths` (down to max_depth), the last rank bucket entirely below its width (accept_prob's),
        read from now on; up to the first level that can accept nothing, where the expected tokens stop growing."""
        levels = []
        for depth, width in enumerate(widths[: self.max_depth], start=1):
            below = bisect.bisect_right(RANK_EDGES, width)
            if not below:
                break
            self._ask(below - 1, depth)
            levels.append(below - 1)
        return tuple(levels)

    def _ask(self, bucket: int, depth: int) -> None:
        """P(rank < RANK_EDGES[bucket]) is read at `depth`: every `_fill` from now on computes it."""
        if not 1 <= depth <= self.max_depth:
            raise IndexError(f"depth {depth} is outside the model's 1..{self.max_depth}")
        if self._asked[bucket] < depth:
            self._asked[bucket] = depth
            self._needed = list(itertools.accumulate(reversed(self._asked), max))[::-1]
            self._stale = True

    def _fill(self) -> None:
        """Every bucket's posterior hazards and acceptance below its edge, as deep as needed (`_needed`), in one
        pass: the candidates read the same every round. Depth by depth, each depth's prior is the estimate of the
        depth above it."""
        # (hits + w * prior) / (trials + w) in stored units: the prior's weight divided by the scale
        weight = self.prior_weight / self._scale
        miss = [1.0] * self._needed[0]  # per depth, P(rank >= the edge of the bucket at hand)
        for j, depth in enumerate(self._needed):
            if not depth:
                break  # nor any bucket past it
            hazards, accept = self._hazards[j], self._accept[j]
            hazards.clear()
            accept.clear()
            prior = self.first_prior[j]
            for d, hits, trials in zip(range(depth), self._hits[j], self._trials[j], strict=False):
                prior = (hits + weight * prior) / (trials + weight)
                hazards.append(prior)
                miss[d] *= 1.0 - prior
                accept.append(1.0 - miss[d])
        self._stale = False

    def observe(
        self, widths: tuple[int, ...], ranks: Sequence[int], *, start: int = 0, open: bool = False
    ) -> None:
        """One speculating round: ranks[d-1] = rank of the accepted node at depth d (len = accepted drafts);
        if fewer than len(widths) were accepted, the next depth saw rank >= its width.

        A round heard in pieces (the shadow lookup's reports, `AdaptivePolicy.observe_shadow`): `ranks` are those
        of depths start + 1 .. start + len(ranks), after the `start` an earlier call of the same round gave (only a
        new round, start 0, decays the counts); `open`: the round is not over, the depths past these are unknown
        (right-censored), so no miss is recorded yet. Its pieces count what the whole round would."""
        self._expected.clear()
        self._stale = True
        if start == 0:
            self._decay()
        # A rank counts a trial for each bucket it reached (start <= rank) and a hit for the one it fell in (none
        # past the last edge); a miss ("rank >= width", censored) a trial for each bucket entirely below the width,
        # the others undecided. In stored units, a count of one is 1 / scale.
        one, hits, trials = 1.0 / self._scale, self._hits, self._trials
        for d, rank in enumerate(ranks[: max(0, self.max_depth - start)], start=start):
            if not rank:  # bucket 0: a lookup chain's every depth past its branch, up to 16 a round
                trials[0][d] += one
                hits[0][d] += one
                continue
            bucket = bisect.bisect_right(RANK_EDGES, rank)  # the bucket `rank` falls in
            for column in trials[: bucket + 1]:
                column[d] += one
            if bucket < len(RANK_EDGES):
                hits[bucket][d] += one
        d = start + len(ranks)
        if not open and d < min(len(widths), self.max_depth):
            for column in trials[: bisect.bisect_right(RANK_EDGES, widths[d])]:
                column[d] += one

    def _decay(self) -> None:
        """Every count times `decay`, as a change of the scale. The scale only shrinks; before a count of one in
        stored units (1 / scale) could overflow, the scale is folded back into the counts."""
        self._scale *= self.decay
        if self._scale < _RESCALE_BELOW:
            for rows in (self._hits, self._trials):
                for row in rows:
                    row[:] = [count * self._scale for count in row]
            self._scale = 1.0


class YieldCalibration:
    """Realised / predicted accepted drafts of the speculating rounds, as decayed sums; `ratio` shrinks toward 1
    with `prior_drafts` of pseudo-observations so one round cannot swing it (see the module docstring)."""

    def __init__(self, *, decay: float = 0.9, prior_drafts: float = 1.0):
        self.decay, self.prior_drafts = decay, prior_drafts
        self.realised = self.predicted = 0.0

    def observe(self, predicted: float, realised: float) -> None:
        self.realised = self.decay * self.realised + realised
        self.predicted = self.decay * self.predicted + predicted

    def add(self, realised: float) -> None:
        """More drafts realised by the round `observe` last began (a shadow lookup heard in pieces): no decay, its
        prediction is already counted."""
        self.realised += realised

    def discount(self, factor: float) -> None:
        """Scale both sums by `factor`: earlier rounds then weigh less against the next ones."""
        self.realised *= factor
        self.predicted *= factor

    @property
    def ratio(self) -> float:
        return (self.realised + self.prior_drafts) / (self.predicted + self.prior_drafts)
