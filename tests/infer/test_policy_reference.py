"""tree="auto"'s host work made cheap (longspec/infer/policy/: counts decayed through a running scale, hazards
and expected tokens computed once per observation and only as far as read, round costs recomputed by index) decides
as the straightforward policy did. The reference here is that policy as first written, kept in this test only:
every count decayed at every observation, every depth's hazards and every candidate's rate and cost recomputed at
every read, from dicts. Both are driven through the same long seeded sequence (choose, observe, observe_shadow in
pieces, observe_time with switches, new calls, contexts across buckets, a cost table that grows): the same choice
every round, the same expected tokens, costs and rates to 1e-9 relative."""

import bisect
import math
import random
import statistics

import pytest

from longspec.infer.candidates import AUTO_LOOKUPS, AUTO_TREES
from longspec.infer.policy import AcceptanceModel, AdaptivePolicy, MeasuredCosts, context_bucket
from longspec.infer.policy.acceptance import RANK_EDGES
from longspec.infer.policy.adaptive import LOOKUP_PRIOR_FIRST, SWITCH_HORIZON
from longspec.infer.policy.costs import OUTLIER_FACTOR
from longspec.infer.policy.shadow import ShadowReport

CANDIDATES = AUTO_TREES + AUTO_LOOKUPS
REL = 1e-9


class ReferenceAcceptance:
    """AcceptanceModel as first written: every count decayed at every new round, every depth's hazards and
    acceptance recomputed after every observation (at the first read)."""

    def __init__(self, max_depth, *, decay=0.97, prior_first=0.5, prior_rest=0.25, prior_weight=2.0):
        self.decay, self.prior_weight = decay, prior_weight
        self.first_prior = [prior_first] + [prior_rest] * (len(RANK_EDGES) - 1)
        self.hits = [[0.0] * len(RANK_EDGES) for _ in range(max_depth)]
        self.trials = [[0.0] * len(RANK_EDGES) for _ in range(max_depth)]
        self._accepts = None

    @property
    def max_depth(self):
        return len(self.hits)

    def _accept(self):
        if self._accepts is None:
            self._accepts = self._posterior_accept()
        return self._accepts

    def _posterior_accept(self):
        prior, accept = self.first_prior, []
        for hits, trials in zip(self.hits, self.trials, strict=True):
            w = self.prior_weight
            prior = [(h + w * p) / (t + w) for h, t, p in zip(hits, trials, prior, strict=True)]
            miss, below = 1.0, []
            for h in prior:
                miss *= 1.0 - h
                below.append(1.0 - miss)
            accept.append(below)
        return accept

    def accept_prob(self, depth, width):
        edges = bisect.bisect_right(RANK_EDGES, width)
        return self._accept()[depth - 1][edges - 1] if edges else 0.0

    def expected_tokens(self, widths):
        total, reach = 1.0, 1.0
        for depth, width in enumerate(widths[: self.max_depth], start=1):
            reach *= self.accept_prob(depth, width)
            total += reach
        return total

    def observe(self, widths, ranks, *, start=0, open=False):
        self._accepts = None
        if start == 0:
            for row_hits, row_trials in zip(self.hits, self.trials, strict=True):
                for j in range(len(RANK_EDGES)):
                    row_hits[j] *= self.decay
                    row_trials[j] *= self.decay
        for depth, rank in enumerate(ranks, start=start + 1):
            if depth > self.max_depth:
                break
            self._record(depth, rank, censored=False)
        accepted = start + len(ranks)
        if not open and accepted < min(len(widths), self.max_depth):
            self._record(accepted + 1, widths[accepted], censored=True)

    def _record(self, depth, rank, *, censored):
        hits, trials = self.hits[depth - 1], self.trials[depth - 1]
        low = 0
        for j, edge in enumerate(RANK_EDGES):
            if censored and edge > rank:
                return
            if not censored and rank < low:
                return
            trials[j] += 1.0
            if not censored and rank < edge:
                hits[j] += 1.0
                return
            low = edge


def reference_monotone(costs):
    return {t: max(costs[s] for s in costs if t.contains(s)) for t in costs}


class ReferenceTable:
    """MeasuredCosts as first written: a bucket's monotone table from a dict, kept until the table grows."""

    def __init__(self, seconds):
        self.seconds, self._tables, self._size = seconds, {}, 0

    def cost(self, widths, context_len):
        bucket = context_bucket(context_len)
        if (bucket, widths) not in self.seconds:
            measured = sorted(b for b, w in self.seconds if w == widths)
            bucket = min(measured, key=lambda b: abs(math.log2(b) - math.log2(bucket)))
        if self._size != len(self.seconds):
            self._tables, self._size = {}, len(self.seconds)
        if bucket not in self._tables:
            self._tables[bucket] = reference_monotone(
                {w: s for (b, w), s in self.seconds.items() if b == bucket}
            )
        return self._tables[bucket][widths]


class ReferenceTimes:
    """RoundTimes as first written: every read recomputes the bucket's costs from dicts, its pairs of trees one
    containing the other walked in full."""

    def __init__(self, base, trees, *, decay=0.9):
        self.base, self.trees, self.decay = base, tuple(trees), decay
        self.mean, self.observed_at, self._observations = {}, {}, 0
        self._cache, self.first_seen = {}, set()

    def observe(self, widths, context_len, seconds):
        bucket = context_bucket(context_len)
        key = (bucket, widths)
        old = self.mean.get(key)
        if old is not None:
            seconds = min(seconds, OUTLIER_FACTOR * old)
        elif key not in self.first_seen and widths in self.trees:
            self.first_seen.add(key)
            if seconds > OUTLIER_FACTOR * self.base.cost(widths, context_len):
                return
        self.mean[key] = seconds if old is None else self.decay * old + (1.0 - self.decay) * seconds
        self._observations += 1
        self.observed_at[key] = self._observations
        self._cache.pop(bucket, None)

    def costs(self, context_len):
        bucket = context_bucket(context_len)
        if bucket in self._cache:
            return self._cache[bucket]
        table = {t: self.base.cost(t, context_len) for t in self.trees}
        seen = {t: self.mean[(bucket, t)] for t in self.trees if (bucket, t) in self.mean}
        if not seen:
            return table
        bounded = dict(seen)
        for big in seen:
            for small in self.trees:
                if small == big or not big.contains(small) or small not in seen:
                    continue
                if table[small] <= 0 or table[big] <= 0:
                    continue
                ratio = table[big] / table[small]
                if self.observed_at[(bucket, big)] > self.observed_at[(bucket, small)]:
                    bounded[small] = min(bounded[small], seen[big] / ratio)
                else:
                    bounded[big] = max(bounded[big], seen[small] * ratio)
        ratios = sorted(bounded[t] / table[t] for t in bounded if table[t] > 0)
        scale = statistics.median(ratios) if ratios else 1.0
        self._cache[bucket] = reference_monotone({t: bounded.get(t, table[t] * scale) for t in self.trees})
        return self._cache[bucket]


class ReferencePolicy(AdaptivePolicy):
    """AdaptivePolicy on the reference models and times, its rates and choice read from dicts as first written
    (the exploration, calibration, switch and shadow logic is the policy's own)."""

    def __init__(self, costs, trees=CANDIDATES, *, learn_times=True):
        drafter_depth = max(t.depth for t in trees if not t.drafts_by_lookup)
        super().__init__(costs, trees, acceptance=ReferenceAcceptance(drafter_depth), learn_times=learn_times)
        self.lookup_acceptance = ReferenceAcceptance(
            max(t.length for t in self.lookups), prior_first=LOOKUP_PRIOR_FIRST
        )
        self.costs = ReferenceTimes(costs, self.trees, decay=0.9 if learn_times else 1.0)

    def _reference_costs(self, context_len):
        costs = self.costs.costs(context_len)
        if not (self._ring_behind and self.switch_s > 0):
            return costs
        extra = self.switch_s / SWITCH_HORIZON
        return {t: cost + extra if t.drafts_with_drafter else cost for t, cost in costs.items()}

    def rates(self, context_len):
        costs = self._reference_costs(context_len)
        return {
            t: self.expected_tokens(t) / costs[t]
            for t in self.trees
            if self._repeating or not (t.drafts_by_lookup and t.branches > 1)
        }

    def snapshot(self, context_len):
        costs, rates = self._reference_costs(context_len), self.rates(context_len)
        return {
            t.name: {
                "expected_tokens": self.expected_tokens(t),
                "cost_ms": costs[t] * 1e3,
                "tokens_per_ms": rate / 1e3,
            }
            for t, rate in rates.items()
        }

    def best(self, context_len):
        rates = self.rates(context_len)
        return max(rates, key=lambda t: rates[t])


def table_seconds(buckets, seed=0):
    """GPU-like round costs per bucket (a plain round ~1.15 ms), each entry jittered so that some measured
    figures invert two trees one containing the other (what monotone corrects)."""
    rng, seconds = random.Random(seed), {}
    for bucket in buckets:
        plain = 1.15e-3 * (1.0 + 0.02 * math.log2(bucket / 1024))
        for c in CANDIDATES:
            if c.drafts_by_lookup:
                factor = 1.15 + 0.004 * (c.nodes - 1)
            else:
                factor = 1.3 + 0.004 * (c.nodes - 1) if c.speculates else 1.0
            seconds[(bucket, c)] = plain * factor * rng.uniform(0.9, 1.1)
    return seconds


class ContextCosts:
    """A stub that prices every context length apart (as the tests' cycling stubs do): RoundTimes must ask it at
    each read, not keep a bucket's figures."""

    def cost(self, widths, context_len):
        wobble = 1.0 + 0.05 * math.sin(context_len / 7.0)
        if widths.drafts_by_lookup:
            return wobble * (1.1 + 0.01 * widths.nodes)
        return wobble * (1.0 + (0.3 if widths.speculates else 0.0) + 0.005 * (widths.nodes - 1))


# (drafter skill, chance a root's lookup matches): drafter good, nothing, quoting, both, some
PHASES = [(0.8, 0.0), (0.0, 0.0), (0.1, 0.85), (0.7, 0.6), (0.4, 0.2)]


def drafter_ranks(rng, widths, skill):
    ranks = []
    for width in widths:
        rank = min(int(rng.expovariate(0.7)), 40) if rng.random() < skill else 1 << 10
        if rank >= width:
            break
        ranks.append(rank)
    return ranks


def lookup_match(rng, repeat):
    if rng.random() >= repeat:
        return () if rng.random() < 0.5 else (0,)
    longest = min(16, 1 + int(rng.expovariate(1 / 6)))
    return (longest,) + tuple(rng.randint(0, longest) for _ in range(3))


def assert_close(got: dict, want: dict):
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=REL), key


def drive(fast, reference, seed, rounds, grow=None):
    """Both policies through the same seeded rounds; every round the same choice and the same beliefs. `grow`
    (round, entries): the fast policy's and the reference's tables gain the same entries at that round, as a
    longer call's measure_round_costs adds buckets."""
    rng = random.Random(seed)
    context, ring_behind, later, first = 1000, False, [], True
    kinds = set()
    for i in range(rounds):
        skill, repeat = PHASES[(i // 150) % len(PHASES)]
        if i and i % 400 == 0:  # a new call
            for policy in (fast, reference):
                policy.start()
            context, ring_behind, later, first = rng.choice([600, 1500, 3000, 6000, 12000]), False, [], True
        elif rng.random() < 0.02:  # a jump across buckets
            context = rng.randint(200, 40000)
        if grow and i == grow[0]:
            for policy in (fast, reference):
                policy.costs.base.seconds.update(grow[1])
        chosen = fast.choose(context)
        assert reference.choose(context) == chosen, i
        kinds.add("lookup" if chosen.drafts_by_lookup else "drafter" if chosen.speculates else "plain")
        assert_close(fast.rates(context), reference.rates(context))
        assert_close(fast.costs.costs(context), reference.costs.costs(context))
        if i % 10 == 0:
            assert_close(
                {(n, f): v for n, fields in fast.snapshot(context).items() for f, v in fields.items()},
                {(n, f): v for n, fields in reference.snapshot(context).items() for f, v in fields.items()},
            )
        # the round's outcome, heard by both
        matched = lookup_match(rng, repeat)
        if chosen.drafts_by_lookup:
            ranks, reports = chosen.ranks(matched), []
        else:
            ranks = drafter_ranks(rng, chosen.model_widths, skill) if chosen.speculates else []
            reports, later = later, []
            if max(matched, default=0) >= 4 and rng.random() < 0.5:  # heard in pieces: open, then the close
                half = max(matched) // 2
                reports.append(ShadowReport(tuple(min(m, half) for m in matched), 0, False))
                later = [ShadowReport(matched, half, True)]
            else:
                reports.append(ShadowReport(matched))
        switched = chosen.drafts_with_drafter and ring_behind
        ring_behind = not chosen.drafts_with_drafter
        seconds = 1e-3 * rng.uniform(1.0, 1.6) + (0.3e-3 if switched else 0.0)
        for policy in (fast, reference):
            if not first:
                policy.observe_time(chosen, context, seconds, switched=switched)
            policy.observe(chosen, ranks, context)
            for report in reports:
                policy.observe_shadow(report)
        first = False
        context += 1 + len(ranks)
    return kinds


def test_the_fast_policy_decides_as_the_reference_on_measured_costs():
    """The engine's path: a MeasuredCosts table refined by learned round times, its table growing mid-run."""
    seconds = table_seconds([1024, 2048, 4096, 8192])
    fast = AdaptivePolicy(MeasuredCosts(seconds=dict(seconds)), CANDIDATES)
    reference = ReferencePolicy(ReferenceTable(dict(seconds)), CANDIDATES)
    kinds = drive(fast, reference, seed=0, rounds=3000, grow=(1700, table_seconds([16384, 32768], seed=1)))
    assert kinds == {"plain", "drafter", "lookup"}  # the sequence exercised every family


@pytest.mark.parametrize("learn_times", [True, False])
def test_the_fast_policy_decides_as_the_reference_on_a_stub_per_context_length(learn_times):
    """An injected cost model that prices each context length apart, learned from (a test's) or authoritative
    (the engine's injected model)."""
    fast = AdaptivePolicy(ContextCosts(), CANDIDATES, learn_times=learn_times)
    reference = ReferencePolicy(ContextCosts(), CANDIDATES, learn_times=learn_times)
    assert len(drive(fast, reference, seed=1, rounds=1500)) >= 2


def test_lazily_decayed_counts_match_eagerly_decayed_ones_through_rescales():
    """At decay 0.5 the running scale passes its floor every ~256 rounds: the counts, once folded back, stay what
    decaying each of them every round gives, and so do the estimates."""
    rng = random.Random(2)
    fast, reference = AcceptanceModel(6, decay=0.5), ReferenceAcceptance(6, decay=0.5)
    for _ in range(3000):
        widths = rng.choice([(4, 16, 16, 16, 16, 16), (1, 1, 1), (2, 2, 2, 2, 2, 2, 2, 2)])
        ranks = drafter_ranks(rng, widths, 0.7)
        for model in (fast, reference):
            model.observe(widths, ranks)
        for got, want in ((fast.hits, reference.hits), (fast.trials, reference.trials)):
            assert got == [pytest.approx(row, rel=REL, abs=1e-300) for row in want]
        assert fast.expected_tokens(widths) == pytest.approx(reference.expected_tokens(widths), rel=REL)
        assert fast.accept_prob(3, 5) == pytest.approx(reference.accept_prob(3, 5), rel=REL)
