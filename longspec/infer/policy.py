"""Adaptive speculation (`tree="auto"`): each round, run the candidate with the most expected tokens per second:
"no speculation" (one plain target step), a drafter tree (level widths), or a prompt-lookup chain (`Lookup`:
n-gram drafts from the sequence's own text, the method pld's, longspec.infer.pld), so tree="auto" never loses to
plain decoding, to the drafter's best tree nor to pld by more than what its estimates get wrong. On long-context
summaries and code, pld beat the drafter-only policy (GPU gov_report 8K: pld 3.25x of AR, longspec 1.32x;
the CPU quickstart: longspec mostly decoded plain), because a text that repeats its document is continued better
by a lookup than by any drafter.

    expected tokens(widths) = 1 + sum_d prod_{i <= d} P(accept at depth i | accepted above, width widths[i-1])
    cost(widths, context)   = measured seconds of the engine's real round (draft + verify + accept + commit)
    pick argmax expected tokens / cost

Lookup chains are a family of their own: an `AcceptanceModel` and a `YieldCalibration` apart from the drafter's
(a low depth-1 prior, LOOKUP_PRIOR_FIRST; a chain's accepted rank is always 0; no match is a miss at depth 1),
since whether a lookup hits follows the text
(quoting, or writing anew) and not the drafter's skill; their costs are measured next to the trees' and are
monotone within their family (`contains`). Besides the lookup rounds' own outcomes, the model hears what the
widest lookup would have accepted at the root of every other round (`observe_shadow`, from `pld.LookupShadow`; one
report stream per lookup round that could have run, none from the roots inside a run an earlier one covers):
without it a plain streak learns of an output that starts to repeat itself only at its next exploration, 16-64
plain rounds later. A stream is heard as the run happens: each round that matched more drafts reports them, the
depths past them unknown (right-censored: no miss recorded), and the text's resolution closes it (the miss past
the last match), so a quote decoded plain raises the lookups' estimate while it goes on, not once it is over;
its pieces count what one whole report would. A lookup round ends the stream where it stands (its own outcome
covers the text from there). So only the drafter needs exploring: out of a plain streak the exploring round is the
drafter's cheapest (the shortest lookup chain where the candidates hold no drafter tree), and whoever runs a
policy with lookups reports the shadow (the engine does, every round). (Exploring the family with the better
estimate instead starved the drafter wherever a lookup round is the cheaper one: at T=1 on the GPU, SmolLM2,
every exploration of 18 samples ran a lookup chain, and the drafter, whose estimate no round revised, never ran
at all.) A fixed tree (`tree_widths=`) runs alone, without lookups, and `GenerationConfig(auto_lookup=False)`
leaves them out.

Acceptance model (`AcceptanceModel`): for the accepted path's node at depth d, its RANK among the level's
candidates (its slot in the level, best first) is observed; a level of width w accepts iff the rank is < w. The
rank's distribution per depth is kept as discrete hazards over rank buckets [0,1) [1,2) [2,4) [4,8) [8,16)
[16,...), h_j = P(rank in bucket j | rank >= bucket j's start), each a decayed success / trial count with a
prior. A rejection at depth d with width w says only "rank >= w" (censored): it counts as a miss for the
buckets below w and says nothing about the others, so one model serves every candidate, including trees that
are not running (Kaplan-Meier style). Counts decay at every round the model observes (the family's own rounds;
for lookups also each shadow lookup's first report), so the estimate follows the text and depths they do not reach
drift back to their prior; while the family does not run, its estimate stands. Depth 1 has a fixed prior;
depth d > 1 takes depth d-1's estimate as its prior (hierarchical): deep levels are reached in few rounds, and
a fixed optimistic prior there overstated a big tree's yield (the first policy kept the full tree at 0.73x of
plain decoding on the GPU, docs/BENCHMARKS.md), while acceptance per level, given the level above was accepted,
changes little with depth. While "no speculation" wins the drafter is not observed: every `explore_every`-th
such round explores instead (the drafter's cheapest round, see above), so the policy can come back; an
exploration after which "no speculation" still wins doubles the interval (up to MAX_EXPLORE_EVERY; each call
starts again from `explore_every`), one that changes the decision resets it, so a drafter that cannot help costs
ever less (at most one chain round in 64: ~1% of the time where a chain round costs 1.5 plain steps). The interval
never drops below what keeps the explorations' extra cost within EXPLORE_BUDGET of plain decoding's, at the round
times learned so far (the exploring round is charged for the ring's catch-up): on the CPU quickstart a one-token
chain after plain rounds costs ~2-2.5 plain steps (1.65-1.8x plus the catch-up, docs/BENCHMARKS.md), and the
schedule alone explores 3 times per 128-token sample (rounds 16, 48, 112: ~3.5% of the decode time); the floor
(~75 rounds there) leaves one. On the GPU (a chain at ~1.4 plain steps) the floor is ~20, close to
`explore_every`.

Yield calibration (`YieldCalibration`): the model's expected accepted drafts (expected tokens minus the bonus
token, which every round emits) are multiplied by the decayed ratio of drafts the speculating rounds really
accepted to what the model predicted for them. Whatever the model gets
wrong (correlation between depths, a new text after one the drafter knew well) shows in that ratio within a
few rounds, so a tree that stops paying is dropped after rounds, not after the model's slower decay. A new
call (a new text) scales that ratio's history by CARRY_OVER: the new text's first rounds set it. Plain rounds
age it (PLAIN_AGING): after a bad burst the ratio drifts back to the acceptance model's long-run estimate, so a
text whose acceptance comes in bursts is not left to plain decoding until an exploration succeeds.

Cost model: anything with `cost(widths, context_len) -> seconds`. `MeasuredCosts` is the engine's table,
measured at warm-up on the actual device per context bucket (SpeculativeEngine.measure_round_costs); tests
inject a stub. Two corrections make the choice robust to timing noise and to what a warm-up cannot see:
- monotone: a tree never costs less than a tree it contains (fewer levels, each no wider), "no speculation"
  included. A millisecond-scale measurement can invert two close candidates; the round's real work cannot.
- online (`RoundTimes`): while decoding, each round's wall time (the round ends with its one host copy, so the
  time is the round's whole cost) updates a decayed mean per (bucket, tree); a drafter round after plain or
  lookup rounds first catches the drafter's ring up, a cost of the switch and not of the tree: it is learned
  apart (`switch_s`) and charged in part to drafter trees while the ring is behind (SWITCH_HORIZON); a tree not
  run yet is priced at
  its table cost times the median ratio observed / table of the trees that ran. A tree's mean goes stale while
  the tree does not run, and a stale mean can be far off: plain rounds slowed by another process sharing the
  CPU once priced "no speculation" above a chain, monotone then raised the chain to that price, and a drafter
  that accepted nothing kept speculating for a whole sample (the CPU quickstart, docs/BENCHMARKS.md). So a
  newer observation of a tree bounds an older one of a tree it contains, or that contains it, by the table's
  ratio of the two (observed(small) <= observed(big) x table(small) / table(big) when big is newer, >= when small
  is newer).
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from longspec.infer.pld import ShadowReport
from longspec.infer.tree import Lookup, candidate_order, is_drafter_tree, tree_name

__all__ = [
    "AUTO_LOOKUPS",
    "AUTO_TREES",
    "DEFAULT_TREE_WIDTHS",
    "AcceptanceModel",
    "AdaptivePolicy",
    "Candidate",
    "CostModel",
    "FixedPolicy",
    "MeasuredCosts",
    "RoundTimes",
    "YieldCalibration",
    "context_bucket",
    "named_by_bucket",
]

DEFAULT_TREE_WIDTHS = (4, 16, 16, 16, 16)  # ALGORITHM §4.1's dynamic beam, the largest tree="auto" candidate

# The candidates of tree="auto": no speculation, short chains, then beam trees up to ALGORITHM §4.1's.
AUTO_TREES: tuple[tuple[int, ...], ...] = (
    (),
    (1,),
    (1, 1),
    (1, 1, 1, 1),
    (2, 2, 2),
    (4, 4, 4),
    (4, 8, 8, 8),
    (4, 16, 16, 16),
    DEFAULT_TREE_WIDTHS,
)

# tree="auto"'s prompt-lookup candidates (GenerationConfig.auto_lookup): chains of 2, 4, 8 and 16 drafts. A lookup
# costs no drafter forward, only its n-gram match and the verify of its chain, so on a text that repeats itself (a
# summary quoting its document, code) a long chain pays where no drafter tree does. Measured on the CPU quickstart
# (eager, 1K / 4K context, ms per round): plain 6.4 / 6.6, lookup 2: 9.7 / 11.0, 4: 8.1 / 11.7, 8: 9.3 / 15.0,
# 12: 10.7 / 17.7, 16: 12.7 / 24.0, 24: 15.9 / 34.4 (the drafter's chain of one: 11.2 / 12.4). Up to 8 drafts
# the match and the round's steps cost more than the chain's tokens; 16 adds ~1.4-1.6x for up to twice the
# tokens where the text loops or quotes at length; past it the verify grows with every draft.
# Forests (several chains of 16, each from another earlier occurrence, `tree.Lookup`) verify 33 / 65 tokens where
# a text repeats itself with variations: replayed over the SmolLM2 GPU evaluation's outputs, a lookup every round
# emits 3.06 tokens a round with one chain of 16, 3.44 with two, 3.71 with four (pld.py says more); on the H200
# they cost 1.05x / 1.13x the chain's round at SmolLM2's shape, T=1 (docs/BENCHMARKS.md), so the policy takes
# them where the text's older occurrences are the ones it continues.
AUTO_LOOKUPS: tuple[Lookup, ...] = (Lookup(2), Lookup(4), Lookup(8), Lookup(16), Lookup(16, 2), Lookup(16, 4))

# A round shape the policy chooses from: a drafter tree's level widths (() = no speculation) or a Lookup chain.
Candidate = tuple[int, ...] | Lookup

RANK_EDGES = (1, 2, 4, 8, 16)  # bucket j = ranks [RANK_EDGES[j-1], RANK_EDGES[j]) (edge -1 = 0)
MIN_BUCKET = 1024  # round costs barely change below this context length
MAX_EXPLORE_EVERY = 64  # a useless drafter then costs at most one cheap chain round in 64
# Explorations' extra cost (exploring round minus a plain round) at most this share of plain decoding's time: the
# floor of the exploration interval where an exploring round costs much more than a plain one (a CPU).
EXPLORE_BUDGET = 0.02
# In a run of plain rounds only the plain rounds' own times change the estimates; re-deciding (every candidate's
# rate) is host work between every two graphed steps, so the decision is re-checked every few rounds.
RECHECK_EVERY = 8
# At a new call the yield calibration's sums (~10 rounds' weight at decay 0.9) are scaled by this: earlier texts
# then weigh about one round against the new text's (AdaptivePolicy.start).
CARRY_OVER = 0.1
# Each plain round scales the yield calibration's sums by this: its evidence is about the text of the last few
# speculating rounds, and acceptance comes in bursts (a model's output alternates between passages the drafter
# continues well and new content). Frozen through a plain streak, one bad burst kept the policy plain until an
# exploration (a chain of one, every 16-64 rounds) happened to succeed; aged, the ratio returns toward 1, i.e. to
# the acceptance model's long-run estimate, within ~10 plain rounds. That estimate is not aged: a drafter that
# cannot help stays unused. (The bursty text of tests/infer/test_policy.py, at the SmolLM2 round costs: 1.06x ->
# 1.15x of plain decoding; a useless drafter unchanged at 0.99x.)
PLAIN_AGING = 0.8
# A drafter round after plain or lookup rounds first catches the drafter's ring up (`DraftStep.catch_up`): a cost
# paid once per switch, not per round. The policy learns it apart from the rounds' own costs (`observe_time`) and
# charges a drafter tree, while the ring is behind, 1 / SWITCH_HORIZON of it: a switch pays when the tree's gain
# over its next few rounds covers it. (Learned into the round's own cost, as before, the catch-up priced the
# drafter's chain of one at T=1 on the GPU ~11% above its steady rounds, 1.56-1.67 ms against 1.45-1.50, since out
# of plain streaks the exploring rounds are the only ones run: docs/BENCHMARKS.md.)
SWITCH_HORIZON = 8
# A round's learned time takes at most this multiple of the tree's running mean per observation. Host noise only
# adds time (a preempted process, a neighbour on a shared machine, a page fault): one round 20x its mean moves
# the decayed mean (decay 0.9) to ~3x, which can price the tree out for dozens of rounds, since the policy then
# seldom runs it to learn better. (Seen, not traced to single rounds: a CPU quickstart on a loaded machine
# decoded plain in 57 of 72 rounds of a sample whose text prompt lookup continued at τ 3.1.) A real rise still
# comes through: a doubled cost is learned at 10% per round.
OUTLIER_FACTOR = 2.0
# The lookup family's depth-1 prior and calibration prior (AdaptivePolicy.__init__ says why they are not the
# drafter's). With the re-decision on accepts (`AdaptivePolicy._hit`), replayed over the GPU's SmolLM2 outputs
# (benchmarks/policy_replay.py): T=0 2.75x -> 2.79x, T=1 1.18x -> 1.21x of plain decoding (docs/BENCHMARKS.md);
# the synthetic texts of tests/infer/test_policy.py keep their assertions.
LOOKUP_PRIOR_FIRST = 0.1
LOOKUP_CALIBRATION_PRIOR = 4.0
# AcceptanceModel stores its counts divided by a running scale that each decay multiplies (`_decay`): far from
# float's smallest normal (~1e-308), so a count of one in stored units (1 / scale) stays finite; at decay 0.97 the
# scale is folded back into the counts every ~5800 observed rounds.
_RESCALE_BELOW = 2.0**-256


def context_bucket(context_len: int) -> int:
    """The cost table's key for a context length: the next power of two, at least MIN_BUCKET."""
    context_len = int(context_len)
    return 1 << (context_len - 1).bit_length() if context_len > MIN_BUCKET else MIN_BUCKET


class CostModel(Protocol):
    def cost(self, widths: Candidate, context_len: int) -> float: ...


def contains(small: Candidate, big: Candidate) -> bool:
    """Whether round `small` does a part of round `big`'s work: tree `small` is a sub-tree of `big` (no more levels,
    each level no wider); a lookup is no longer and has no more branches than the other; no speculation is part of
    every round. A lookup and a drafter tree are of different families (one runs the drafter, the other an n-gram
    match): neither bounds the other's cost."""
    if not small:
        return True
    if isinstance(small, Lookup) or isinstance(big, Lookup):
        return (
            isinstance(small, Lookup)
            and isinstance(big, Lookup)
            and small.length <= big.length
            and small.branches <= big.branches
        )
    return len(small) <= len(big) and all(a <= b for a, b in zip(small, big, strict=False))


class _Containment:
    """`contains` over a fixed list of distinct candidates, by index, for what the policy recomputes every round:
    `pairs`, each (big, small) with big containing small (big by big, each's smalls in list order), and what
    `monotone` walks: only the (small, big) pairs where big contains small immediately (`contains` is transitive,
    so raising each candidate to those, in an order where each comes after all it contains, raises it to all)."""

    def __init__(self, trees: Sequence[Candidate]):
        n = len(trees)
        below = [[j for j in range(n) if j != i and contains(trees[j], trees[i])] for i in range(n)]
        self.pairs = [(big, small) for big in range(n) for small in below[big]]
        # A candidate contains strictly more than any it contains: by that count, each comes after what it contains.
        order = sorted(range(n), key=lambda i: len(below[i]))
        self._steps = [(j, i) for i in order for j in below[i] if not any(j in below[k] for k in below[i])]

    def monotone(self, costs: Sequence[float]) -> list[float]:
        """Each candidate's cost raised to the most expensive candidate it contains (see the module docstring)."""
        out = list(costs)
        for small, big in self._steps:
            if out[small] > out[big]:
                out[big] = out[small]
        return out


@dataclass
class MeasuredCosts:
    """seconds[(bucket, widths)] of one round, measured on the device in one decoding mode (acceptance rule,
    static shapes, CUDA graphs, batch size: `round_costs.cost_mode`, the key of `engine.cost_tables`): a round's
    cost depends on it, so each mode has a table of its own."""

    seconds: dict[tuple[int, tuple[int, ...]], float] = field(default_factory=dict)
    # monotone table per bucket, rebuilt when `seconds` grows (measure_round_costs only adds buckets)
    _tables: dict[int, dict[tuple[int, ...], float]] = field(default_factory=dict, repr=False)
    _size: int = field(default=0, repr=False)

    def cost(self, widths: tuple[int, ...], context_len: int) -> float:
        bucket = context_bucket(context_len)
        if (bucket, widths) not in self.seconds:
            # Past the measured buckets (a longer call than the warm-up planned for): the nearest one measured.
            measured = sorted(b for b, w in self.seconds if w == widths)
            bucket = min(measured, key=lambda b: abs(math.log2(b) - math.log2(bucket)))
        if self._size != len(self.seconds):
            self._tables, self._size = {}, len(self.seconds)
        if bucket not in self._tables:
            table = {w: s for (b, w), s in self.seconds.items() if b == bucket}
            self._tables[bucket] = dict(
                zip(table, _Containment(list(table)).monotone(list(table.values())), strict=True)
            )
        return self._tables[bucket][widths]

    def missing(self, trees: Sequence[tuple[int, ...]], buckets: Sequence[int]) -> list[int]:
        return [b for b in buckets if any((b, w) not in self.seconds for w in trees)]

    def to_dict(self) -> dict:
        return named_by_bucket(self.seconds)


def named_by_bucket(seconds: dict) -> dict[str, float]:
    """A per (context bucket, candidate) table keyed "bucket:name" (`tree_name`), buckets ascending and in each
    the candidates in `candidate_order` (a Lookup does not compare with level widths): for reports and JSON."""
    items = sorted(seconds.items(), key=lambda item: (item[0][0], *candidate_order(item[0][1])))
    return {f"{b}:{tree_name(w)}": s for (b, w), s in items}


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


@dataclass
class _BucketTimes:
    """What one context bucket's rounds showed, by tree index (RoundTimes.trees): each tree's decayed mean (None:
    not run here yet) and its update's observation count; the trees that ran, in index order; the pairs
    (`_Containment.pairs`) whose trees both ran."""

    means: list[float | None]
    when: list[int]
    ran: list[int] = field(default_factory=list)
    pairs: list[tuple[int, int]] = field(default_factory=list)


class RoundTimes:
    """Round costs learned while decoding, on top of a table (`base`): a decayed mean of the observed wall time
    per (context bucket, tree); unobserved trees get the table cost times the median observed / table ratio of
    the trees that ran in that bucket; the result is made monotone (see the module docstring)."""

    def __init__(self, base: CostModel, trees: Sequence[tuple[int, ...]], *, decay: float = 0.9):
        self.base, self.trees, self.decay = base, tuple(dict.fromkeys(trees)), decay
        self.mean: dict[tuple[int, tuple[int, ...]], float] = {}
        self.observed_at: dict[
            tuple[int, tuple[int, ...]], int
        ] = {}  # the observation count at its last update
        self._observations = 0
        self._index = {t: i for i, t in enumerate(self.trees)}
        self._containment = _Containment(self.trees)
        # Every round's time changes a bucket's costs, and the policy reads them every round: they are recomputed
        # from lists by tree index, `mean` and `observed_at` as they stand per bucket (`_note`) and a MeasuredCosts
        # base's figures per bucket (`_table`), and kept until the bucket's next observation.
        self._buckets: dict[int, _BucketTimes] = {}
        self._tables: dict[int, tuple[int, list[float]]] = {}
        self._cache: dict[int, list[float]] = {}

    def observe(self, widths: tuple[int, ...], context_len: int, seconds: float) -> None:
        bucket = context_bucket(context_len)
        tree = _candidate(widths)
        key = (bucket, tree)
        old = self.mean.get(key)
        if old is not None:
            seconds = min(seconds, OUTLIER_FACTOR * old)
        self.mean[key] = mean = seconds if old is None else self.decay * old + (1.0 - self.decay) * seconds
        self._observations += 1
        self.observed_at[key] = self._observations
        self._cache.pop(bucket, None)
        i = self._index.get(tree)
        if i is not None:
            self._note(bucket, i, mean)

    def _note(self, bucket: int, i: int, mean: float) -> None:
        """Tree `i`'s new mean into its bucket's lists; a tree's first run there adds it to those that ran."""
        times = self._buckets.get(bucket)
        if times is None:
            times = self._buckets[bucket] = _BucketTimes([None] * len(self.trees), [0] * len(self.trees))
        if times.means[i] is None:
            times.ran = sorted(times.ran + [i])
            times.pairs = [(b, s) for b, s in self._containment.pairs if b in times.ran and s in times.ran]
        times.means[i], times.when[i] = mean, self._observations

    def costs(self, context_len: int) -> dict[tuple[int, ...], float]:
        return dict(zip(self.trees, self.cost_list(context_len), strict=True))

    def cost_list(self, context_len: int) -> list[float]:
        """`costs` as a list in `trees` order (what the policy reads every round). Not to be modified: it is
        cached."""
        bucket = context_bucket(context_len)
        costs = self._cache.get(bucket)
        if costs is not None:
            return costs
        table = self._table(context_len, bucket)
        times = self._buckets.get(bucket)
        if times is None:
            return table  # the table as given (MeasuredCosts is monotone itself; a test stub need not be)
        costs = self._cache[bucket] = self._calibrated(table, times.ran, self._bounded(table, times))
        return costs

    def _table(self, context_len: int, bucket: int) -> list[float]:
        """The base's cost of every tree at `context_len`. A MeasuredCosts prices a whole bucket alike, until it
        measures more (it only adds entries): its figures are read once per bucket and size. Any other cost model
        may price each context length apart (the tests' stubs do): it is asked every time."""
        if not isinstance(self.base, MeasuredCosts):
            return [self.base.cost(t, context_len) for t in self.trees]
        size = len(self.base.seconds)
        known = self._tables.get(bucket)
        if known is None or known[0] != size:
            known = self._tables[bucket] = (size, [self.base.cost(t, context_len) for t in self.trees])
        return known[1]

    def _bounded(self, table: list[float], times: _BucketTimes) -> list[float | None]:
        """The observed means, each pair of trees one containing the other held to the table's ratio where the
        newer figure says so (it tells what the machine does now): a smaller tree's older mean is capped at the
        bigger one's newer mean x table(small) / table(big), a bigger tree's older mean raised to the smaller
        one's newer mean x table(big) / table(small)."""
        means, when = times.means, times.when
        bounded = list(means)
        for big, small in times.pairs:
            if table[small] <= 0 or table[big] <= 0:
                continue
            ratio = table[big] / table[small]
            if when[big] > when[small]:
                bounded[small] = min(bounded[small], means[big] / ratio)
            else:
                bounded[big] = max(bounded[big], means[small] * ratio)
        return bounded

    def _calibrated(self, table: list[float], ran: list[int], seen: list[float | None]) -> list[float]:
        ratios = sorted(seen[i] / table[i] for i in ran if table[i] > 0)
        # the median (of an even count, the mean of the middle two: the upper one alone priced every unobserved
        # tree at the dearer of two observed ratios)
        scale = statistics.median(ratios) if ratios else 1.0
        costs = [cost * scale for cost in table]
        for i in ran:
            costs[i] = seen[i]
        return self._containment.monotone(costs)

    def cost(self, widths: tuple[int, ...], context_len: int) -> float:
        return self.costs(context_len)[_candidate(widths)]


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


class FixedPolicy:
    """Every round the same candidate, nothing learned: the user's fixed tree, or pld's lookup chain."""

    def __init__(self, widths: Candidate):
        self.widths = _candidate(widths)

    def choose(self, context_len: int) -> Candidate:
        return self.widths

    def observe(self, widths: Candidate, ranks: Sequence[int], context_len: int | None = None) -> None:
        pass

    def observe_time(
        self, widths: Candidate, context_len: int, seconds: float, *, switched: bool = False
    ) -> None:
        pass


class AdaptivePolicy:
    """tree="auto": argmax over the candidates (`trees`: drafter trees, no speculation, lookup chains) of expected
    tokens / cost, with exploration out of "no speculation"."""

    def __init__(
        self,
        costs: CostModel,
        trees: Sequence[Candidate] = AUTO_TREES,
        *,
        explore_every: int = 16,
        acceptance: AcceptanceModel | None = None,
        learn_times: bool = True,
    ):
        self.trees = tuple(dict.fromkeys(_candidate(t) for t in trees))
        if not self.trees:
            raise ValueError("the adaptive policy needs at least one candidate tree")
        # learn_times=False: `costs` is authoritative (an injected model), observed round times are ignored.
        self.costs = RoundTimes(costs, self.trees, decay=0.9 if learn_times else 1.0)
        self.learn_times = learn_times
        self.explore_every = explore_every
        drafter_trees = [t for t in self.trees if not isinstance(t, Lookup)]
        lookups = [t for t in self.trees if isinstance(t, Lookup)]
        self.lookups = tuple(lookups)
        # The candidates by family, as (index in `trees`, level widths its model sees), for `_rates` (every
        # round); the lookup forests apart from the chains (candidates once the text repeats, `rates`).
        self._plain = [i for i, t in enumerate(self.trees) if not t]
        self._drafters = [(i, t) for i, t in enumerate(self.trees) if is_drafter_tree(t)]
        self._chains = [
            (i, t.widths) for i, t in enumerate(self.trees) if isinstance(t, Lookup) and t.branches == 1
        ]
        self._forests = [
            (i, t.widths) for i, t in enumerate(self.trees) if isinstance(t, Lookup) and t.branches > 1
        ]
        # the candidate the shadow's reports are learned as (`observe_shadow`)
        self._widest = max(lookups, key=lambda t: (t.branches, t.length), default=None)
        self.acceptance = acceptance or AcceptanceModel(max((len(t) for t in drafter_trees), default=1) or 1)
        self.calibration = YieldCalibration()
        # Lookup chains have a model and a calibration of their own: their acceptance is the text's
        # repetitiveness, not the drafter's skill, and the two change independently (a summary quoting its
        # document, then paraphrasing). A chain's rank is always 0; no match is a miss at depth 1.
        # Its depth-1 prior is low (LOOKUP_PRIOR_FIRST): the shadow reports an outcome every round, so a prior
        # is soon outweighed, and the drafter's 0.5 ("the text repeats itself at half its roots") held the
        # lookups' estimate near a lookup round's break-even, where one hit started a burst of lookup rounds.
        self.lookup_acceptance = AcceptanceModel(
            max((t.length for t in lookups), default=1), prior_first=LOOKUP_PRIOR_FIRST
        )
        # Its calibration has more pseudo-drafts (LOOKUP_CALIBRATION_PRIOR): a lookup's yield is heavy-tailed
        # (nothing, or a run of drafts), and with the drafter's one pseudo-draft a single hit multiplied the
        # lookups' estimate several-fold for the next ~10 rounds.
        self.lookup_calibration = YieldCalibration(prior_drafts=LOOKUP_CALIBRATION_PRIOR)
        # The round that explores out of a plain streak (`choose`): the drafter's cheapest; the lookups' estimate
        # is kept by the shadow reports (`observe_shadow`), unless there is no drafter tree to explore.
        speculating = [t for t in drafter_trees if t]
        self._explore: Candidate | None = (
            min(speculating, key=lambda t: (sum(t), len(t)))
            if speculating
            else min(lookups, key=lambda t: t.length, default=None)
        )
        self._plain_streak = 0
        self._interval = explore_every  # grows while explorations fail (see the module docstring)
        self._exploring = False
        self._decision: tuple | None = None  # (context bucket, best, floor) of the last check
        # The ring's catch-up before a drafter round that follows plain or lookup rounds: its learned seconds (a
        # decayed mean, `observe_time`) and whether the last round chosen left the ring behind.
        self.switch_s = 0.0
        self._switches = 0
        self._ring_behind = False
        # Whether this call's text has repeated itself yet (a lookup hit, from a lookup round or the shadow):
        # until then the lookup forests (branches > 1) are no candidates (`rates`, `start`).
        self._repeating = False

    def start(self) -> None:
        """A new generation: a new prompt is a new text. The acceptance estimates stay (a short output need not
        re-learn them from the prior), but the yield calibration's history is scaled by CARRY_OVER, so the
        realised yield of this text's own first rounds corrects them at once: on the GPU, after samples the
        drafter predicted well (looping references, τ 3-4), the full history kept a tree running for all 19
        rounds of a 23-token answer at τ 1.16 (0.68x of plain decoding). (Scaling the acceptance counts as well
        lets the generic prior take over again at every call, and a drafter that cannot help is tried anew each
        time.) The exploration schedule starts over too: keeping a backed-off interval across calls left the
        policy on plain decoding through whole samples where the full tree had paid 1.6x before."""
        self.calibration.discount(CARRY_OVER)
        self.lookup_calibration.discount(CARRY_OVER)
        self._repeating = False
        self._ring_behind = False  # a call's ring starts complete (its prefill)
        self._plain_streak, self._interval, self._exploring, self._decision = (
            0,
            self.explore_every,
            False,
            None,
        )

    def expected_tokens(self, widths: Candidate) -> float:
        """The acceptance model's expected tokens for a candidate (its family's model), calibrated by its
        family's realised yield."""
        if not widths:
            return 1.0
        model, calibration, widths = self._family(widths)
        return 1.0 + (model.expected_tokens(widths) - 1.0) * calibration.ratio

    def _family(self, candidate: Candidate) -> tuple[AcceptanceModel, YieldCalibration, tuple[int, ...]]:
        """A speculating candidate's acceptance model and yield calibration (the drafter's, or the lookup
        chains'), and its level widths as that model sees them."""
        if isinstance(candidate, Lookup):
            return self.lookup_acceptance, self.lookup_calibration, candidate.widths
        return self.acceptance, self.calibration, candidate

    def _learn(
        self, candidate: Candidate, ranks: Sequence[int], *, start: int = 0, open: bool = False
    ) -> None:
        """A speculating round's outcome into its family's calibration (realised vs predicted drafts) and model;
        `start`, `open`: a piece of a round heard in pieces (`AcceptanceModel.observe`), whose first piece
        (start 0) brought the round's prediction."""
        model, calibration, widths = self._family(candidate)
        if start == 0:
            calibration.observe(model.expected_tokens(widths) - 1.0, len(ranks))
        else:
            calibration.add(len(ranks))
        model.observe(widths, ranks, start=start, open=open)
        self._repeating |= isinstance(candidate, Lookup) and bool(ranks)

    def rates(self, context_len: int) -> dict[Candidate, float]:
        """Expected tokens per second of every candidate at this context length; a lookup forest (branches > 1)
        only once this call's text has repeated itself (a lookup hit, `_learn`). Why: a call's first rounds are
        chosen from estimates carried over from earlier texts, and a forest's extra branches pay only on a text
        that repeats; where nothing matches it costs more than the chain for the same one token (1.18x at
        SmolLM2, 4K). On a 7-token answer those first rounds are the whole call: replayed over a GPU run's T=0
        outputs (`benchmarks/policy_replay.py`), 0.73x -> 0.84x of plain decoding there (the chain's every
        round: 0.84x), mean 3.054 -> 3.107x (docs/BENCHMARKS.md)."""
        return {
            t: rate for t, rate in zip(self.trees, self._rates(context_len), strict=True) if rate is not None
        }

    def _rates(self, context_len: int) -> list[float | None]:
        """`rates` in `trees` order, None for a forest left out: what `best` reads every round, family by family
        (each one's model and calibration read once)."""
        costs = self._cost_list(context_len)
        rates: list[float | None] = [None] * len(costs)
        for i in self._plain:
            rates[i] = 1.0 / costs[i]
        for members, model, calibration in (
            (self._drafters, self.acceptance, self.calibration),
            (self._chains, self.lookup_acceptance, self.lookup_calibration),
            (self._forests if self._repeating else (), self.lookup_acceptance, self.lookup_calibration),
        ):
            expected, ratio = model.expected_tokens, calibration.ratio
            for i, widths in members:
                rates[i] = (1.0 + (expected(widths) - 1.0) * ratio) / costs[i]  # expected_tokens(t) / cost
        return rates

    def _cost_list(self, context_len: int) -> list[float]:
        """Each candidate's cost for the next round, in `trees` order: its steady round cost (`RoundTimes`), plus
        for a drafter tree SWITCH_HORIZON's share of the ring's catch-up while the ring is behind (see
        SWITCH_HORIZON)."""
        costs = self.costs.cost_list(context_len)
        if not (self._ring_behind and self.switch_s > 0):
            return costs
        costs = list(costs)
        for i, _ in self._drafters:
            costs[i] += self.switch_s / SWITCH_HORIZON
        return costs

    def snapshot(self, context_len: int) -> dict[str, dict[str, float]]:
        """What the policy believes at `context_len`, per candidate by name (`tree_name`): expected tokens per
        round (calibrated), cost per round in ms (the measured table refined by observed round times, plus the
        switch's share while the ring is behind) and their
        ratio in tokens per ms: why it ran what it ran (a call's stats carry it: GenerationStats.policy)."""
        costs, rates = (
            dict(zip(self.trees, self._cost_list(context_len), strict=True)),
            self.rates(context_len),
        )
        return {
            tree_name(t): {
                "expected_tokens": self.expected_tokens(t),
                "cost_ms": costs[t] * 1e3,
                "tokens_per_ms": rate / 1e3,
            }
            for t, rate in rates.items()
        }

    def best(self, context_len: int) -> Candidate:
        """The candidate with the most expected tokens per second (first of equals: the cheaper end)."""
        best, top = None, 0.0
        for t, rate in zip(self.trees, self._rates(context_len), strict=True):
            if rate is not None and (best is None or rate > top):
                best, top = t, rate
        return best

    def choose(self, context_len: int) -> Candidate:
        """`best`, except where it is no speculation: every `_interval`-th consecutive such round (at least the
        budget's floor, `_floor`) explores, with the drafter's cheapest round (`_explore`). In a plain streak the
        decision is re-checked every RECHECK_EVERY rounds or when the context bucket changes."""
        bucket = context_bucket(context_len)
        if self._decision is None or self._decision[0] != bucket or self._plain_streak % RECHECK_EVERY == 0:
            best = self.best(context_len)
            self._decision = (bucket, best, self._floor(context_len) if not best else 0)  # floor: plain only
        _, best, floor = self._decision
        if best:
            self._plain_streak = 0
        else:
            self._plain_streak += 1
            if (
                self.explore_every
                and self._explore is not None
                and self._plain_streak % max(self._interval, floor) == 0
            ):
                self._exploring = True
                best = self._explore
        self._ring_behind = not is_drafter_tree(best)
        return best

    def _floor(self, context_len: int) -> int:
        """The fewest plain rounds between explorations that keeps their extra cost within EXPLORE_BUDGET, priced
        at the exploring round's cost (decided with `best`, every RECHECK_EVERY rounds of a plain streak: the
        learned times change every round)."""
        costs = self.costs.costs(context_len)
        plain = costs[()] if () in costs else min(costs.values())
        explore = plain if self._explore is None else costs[self._explore]
        if is_drafter_tree(self._explore):
            explore += self.switch_s  # out of a plain streak it catches the ring up
        if plain <= 0:
            return 1
        return max(1, math.ceil((explore - plain) / (EXPLORE_BUDGET * plain)))

    def observe(self, widths: Candidate, ranks: Sequence[int], context_len: int | None = None) -> None:
        """A round's outcome: ranks of its accepted nodes (see AcceptanceModel.observe; a lookup chain's are all
        0). `context_len` (the round's) lets an exploration judge whether it changed the decision; without it,
        any accept counts. An accept reaching a plain streak (the speculating round before it, heard a round
        late) makes the streak decide again at its next round (`_hit`)."""
        if widths:
            self._learn(widths, ranks)
            if ranks:
                self._hit()
        else:
            self.calibration.discount(PLAIN_AGING)
            self.lookup_calibration.discount(PLAIN_AGING)
        if self._exploring:
            self._exploring = False
            self._plain_streak = 0
            self._decision = None
            pays = bool(ranks) if context_len is None else bool(self.best(context_len))
            self._interval = self.explore_every if pays else min(2 * self._interval, MAX_EXPLORE_EVERY)

    def observe_shadow(self, report: ShadowReport) -> None:
        """What the widest lookup candidate would have accepted at the root of a round that ran no lookup
        (`pld.LookupShadow`: the drafts each of its branches matched so far, best match first; () when nothing
        matched): the lookup family's model and calibration learn it as from a lookup round (its branch, the first
        that matched the most, at depth 1), so a text that starts repeating itself is seen in plain and drafter
        rounds too, not only at an exploration. A lookup is heard in pieces, as its run happens: the first report
        is a new round (decay, the model's prediction), each later one adds the depths matched since (their
        ranks 0: depth 1's was the first report's), and the closed one the miss past them; an open report's
        depths beyond are unknown, not missed. The exploration state is left alone (an exploring round's own
        outcome decides its interval); a hit makes a plain streak decide again at its next round (`_hit`)."""
        if self._widest is None:
            return
        ranks = self._widest.ranks(report.matched)
        # the shadow drafts as many as the longest lookup: the widest may take fewer
        start = min(report.reported, len(ranks))
        self._learn(self._widest, ranks[start:], start=start, open=not report.done)
        if len(ranks) > start:
            self._hit()

    def _hit(self) -> None:
        """An observed accept: a plain streak's cached decision is dropped, so its next round decides again
        instead of its next re-check (RECHECK_EVERY). The re-check saves host work while nothing can change the
        decision; an accept is what raises an estimate (a miss only lowers one). Waiting for it cost the rounds in
        which the text had started to repeat itself: on the GPU's gov_report_8k at T=0, up to 7 plain rounds in
        which a lookup chain would have accepted ~10 drafts each (replayed by `benchmarks/policy_replay.py`, with
        the LOOKUP_* priors: that sample 4.12x -> 4.34x of plain decoding). With the drafter's priors for the
        lookups it would act at once on the burst a single hit starts: in
        `test_one_lookup_hit_does_not_start_a_burst_of_lookup_rounds`, lookup rounds 25% of rounds and 1.07x of
        plain decoding, against 9% and 1.13x with the LOOKUP_* priors."""
        if self._decision is not None and not self._decision[1]:
            self._decision = None

    def observe_time(
        self, widths: Candidate, context_len: int, seconds: float, *, switched: bool = False
    ) -> None:
        """The wall time of a round just run (its whole cost: it ended with its host copy). `switched`: the ring
        caught up before it (a drafter round after plain or lookup rounds): what it took beyond the round's steady
        cost is the switch's (`switch_s`, see SWITCH_HORIZON), and the round's own estimate is left alone."""
        if not self.learn_times:
            return
        if switched:
            extra = max(0.0, seconds - self.costs.costs(context_len)[_candidate(widths)])
            self._switches += 1
            # a decayed mean (decay 0.9, as the rounds' times), the first observation taken whole
            weight = max(0.1, 1.0 / self._switches)
            self.switch_s += weight * (extra - self.switch_s)
            return
        self.costs.observe(widths, context_len, seconds)


def _candidate(widths) -> Candidate:
    """A candidate in its hashable form: a Lookup as it is, level widths as a tuple of ints."""
    return widths if isinstance(widths, Lookup) else tuple(map(int, widths))
