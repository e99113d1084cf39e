"""tree="auto"'s round costs: the table measured on the device (`MeasuredCosts`, per context bucket and decoding
mode) and the costs learned while decoding on top of it (`RoundTimes`).

Two corrections make the choice robust to timing noise and to what a warm-up cannot see:
- monotone: a round never costs less than a round it contains (`RoundShape.contains`), "no speculation"
  included; a millisecond-scale measurement can invert two close candidates, the round's real work cannot.
- online: each round's wall time updates a decayed mean per (bucket, candidate) (a first round far above the
  table is first-use work, not learned); a candidate not run yet is
  priced at its table cost times the median ratio observed / table of those that ran; a newer observation of a
  candidate bounds an older one of a candidate it contains, or that contains it, by the table's ratio of the two
  (a stale mean can be far off).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from longspec.infer.candidates import RoundShape, as_shape

__all__ = [
    "MIN_BUCKET",
    "OUTLIER_FACTOR",
    "CostModel",
    "MeasuredCosts",
    "RoundTimes",
    "context_bucket",
    "named_by_bucket",
]

MIN_BUCKET = 1024  # round costs barely change below this context length
# A round's learned time takes at most this multiple of the candidate's running mean per observation: host noise
# only adds time, and one outlier in a decayed mean would price a candidate out for many rounds, while a real rise
# still comes through.
OUTLIER_FACTOR = 2.0


def context_bucket(context_len: int) -> int:
    """The cost table's key for a context length: the next power of two, at least MIN_BUCKET."""
    context_len = int(context_len)
    return 1 << (context_len - 1).bit_length() if context_len > MIN_BUCKET else MIN_BUCKET


class CostModel(Protocol):
    def cost(self, widths: RoundShape, context_len: int) -> float: ...


class _Containment:
    """`RoundShape.contains` over a fixed list of distinct candidates, by index, for what the policy recomputes every round:
    `pairs`, each (big, small) with big containing small (big by big, each's smalls in list order), and what
    `monotone` walks: only the (small, big) pairs where big contains small immediately (`contains` is transitive,
    so raising each candidate to those, in an order where each comes after all it contains, raises it to all)."""

    def __init__(self, trees: Sequence[RoundShape]):
        n = len(trees)
        below = [[j for j in range(n) if j != i and trees[i].contains(trees[j])] for i in range(n)]
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
    """seconds[(bucket, shape)] of one round, measured on the device in one decoding mode (acceptance rule,
    static shapes, CUDA graphs, batch size: `measure.cost_mode`, the key of `engine.cost_tables`): a round's
    cost depends on it, so each mode has a table of its own."""

    seconds: dict[tuple[int, RoundShape], float] = field(default_factory=dict)
    # monotone table per bucket, rebuilt when `seconds` grows (measure_round_costs only adds buckets)
    _tables: dict[int, dict[RoundShape, float]] = field(default_factory=dict, repr=False)
    _size: int = field(default=0, repr=False)

    def cost(self, widths: RoundShape, context_len: int) -> float:
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

    def missing(self, trees: Sequence[RoundShape], buckets: Sequence[int]) -> list[int]:
        return [b for b in buckets if any((b, w) not in self.seconds for w in trees)]

    def to_dict(self) -> dict:
        return named_by_bucket(self.seconds)


def named_by_bucket(seconds: dict) -> dict[str, float]:
    """A per (context bucket, candidate) table keyed "bucket:name" (`RoundShape.name`), buckets ascending and in
    each the candidates by `RoundShape.sort_key`: for reports and JSON."""
    items = sorted(seconds.items(), key=lambda item: (item[0][0], *item[0][1].sort_key))
    return {f"{b}:{w.name}": s for (b, w), s in items}


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

    def __init__(self, base: CostModel, trees: Sequence[RoundShape], *, decay: float = 0.9):
        self.base, self.trees, self.decay = base, tuple(dict.fromkeys(as_shape(t) for t in trees)), decay
        self.mean: dict[tuple[int, RoundShape], float] = {}
        self.observed_at: dict[tuple[int, RoundShape], int] = {}  # the observation count at its last update
        self._observations = 0
        # (bucket, tree) pairs whose first round came (`observe`)
        self._first_seen: set[tuple[int, RoundShape]] = set()
        self._index = {t: i for i, t in enumerate(self.trees)}
        self._containment = _Containment(self.trees)
        # Every round's time changes a bucket's costs, and the policy reads them every round: they are recomputed
        # from lists by tree index, `mean` and `observed_at` as they stand per bucket (`_note`) and a MeasuredCosts
        # base's figures per bucket (`_table`), and kept until the bucket's next observation.
        self._buckets: dict[int, _BucketTimes] = {}
        self._tables: dict[int, tuple[int, list[float]]] = {}
        self._cache: dict[int, list[float]] = {}

    def observe(self, widths: RoundShape, context_len: int, seconds: float) -> None:
        bucket = context_bucket(context_len)
        tree = as_shape(widths)
        key = (bucket, tree)
        old = self.mean.get(key)
        i = self._index.get(tree)
        if old is not None:
            seconds = min(seconds, OUTLIER_FACTOR * old)
        elif key not in self._first_seen and i is not None:
            # A candidate's first round in this process may carry first-use work (lazy initialisation, buffers)
            # that is no part of its cost: a table read from disk was measured by another process, so nothing
            # here ran the round before. One that far exceeds the table's price is not learned; the next is.
            self._first_seen.add(key)
            if seconds > OUTLIER_FACTOR * self._table(context_len, bucket)[i]:
                return
        self.mean[key] = mean = seconds if old is None else self.decay * old + (1.0 - self.decay) * seconds
        self._observations += 1
        self.observed_at[key] = self._observations
        self._cache.pop(bucket, None)
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

    def costs(self, context_len: int) -> dict[RoundShape, float]:
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

    def cost(self, widths: RoundShape, context_len: int) -> float:
        return self.costs(context_len)[as_shape(widths)]
