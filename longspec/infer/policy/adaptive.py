"""tree="auto"'s rule: each round, run the candidate with the most expected tokens per second (a plain step, a
drafter tree or a prompt-lookup chain), with explorations out of "no speculation" so the policy can come back.

    pick argmax expected tokens (acceptance.AcceptanceModel, calibrated) / cost (costs.RoundTimes)

Lookup chains are a family of their own (a model and a calibration apart from the drafter's): whether a lookup
hits follows the text, not the drafter's skill. Besides the lookup rounds' own outcomes, the model hears what the
widest lookup would have accepted at every other round's root (`observe_shadow`, from `shadow.LookupShadow`), so
only the drafter needs exploring. docs/ALGORITHM.md gives the reasoning behind each constant.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from longspec.infer.candidates import AUTO_TREES, Plain, RoundShape, as_shape
from longspec.infer.policy.acceptance import AcceptanceModel, YieldCalibration
from longspec.infer.policy.costs import CostModel, RoundTimes, context_bucket
from longspec.infer.policy.shadow import ShadowReport

__all__ = ["AdaptivePolicy", "FixedPolicy"]

MAX_EXPLORE_EVERY = 64  # the longest interval between explorations: a useless drafter costs little
# Explorations' extra cost (exploring round minus a plain round) at most this share of plain decoding's time: the
# floor of the exploration interval where an exploring round costs much more than a plain one.
EXPLORE_BUDGET = 0.02
# In a plain streak the decision is re-checked every this many rounds (re-deciding is host work between rounds).
RECHECK_EVERY = 8
# At a new call the yield calibration's sums are scaled by this: the new text's first rounds set the ratio.
CARRY_OVER = 0.1
# Each plain round scales the yield calibration's sums by this: acceptance comes in bursts, and an aged ratio
# drifts back to the acceptance model's long-run estimate instead of keeping the policy plain after a bad burst.
PLAIN_AGING = 0.8
# A drafter round after plain or lookup rounds first catches the drafter's ring up: a cost paid once per switch,
# learned apart (`switch_s`) and charged to drafter trees at 1 / SWITCH_HORIZON while the ring is behind.
SWITCH_HORIZON = 8
# The lookup family's depth-1 prior (low: a shadow reports every round, and a high prior made one hit start a
# burst of lookup rounds) and its calibration's pseudo-drafts (a lookup's yield is heavy-tailed).
LOOKUP_PRIOR_FIRST = 0.1
LOOKUP_CALIBRATION_PRIOR = 4.0


class FixedPolicy:
    """Every round the same candidate, nothing learned: the user's fixed tree, or pld's lookup chain."""

    def __init__(self, widths: RoundShape):
        self.widths = as_shape(widths)

    def choose(self, context_len: int) -> RoundShape:
        return self.widths

    def observe(self, widths: RoundShape, ranks: Sequence[int], context_len: int | None = None) -> None:
        pass

    def observe_time(
        self, widths: RoundShape, context_len: int, seconds: float, *, switched: bool = False
    ) -> None:
        pass


class AdaptivePolicy:
    """tree="auto": argmax over the candidates (`trees`: drafter trees, no speculation, lookup chains) of expected
    tokens / cost, with exploration out of "no speculation"."""

    def __init__(
        self,
        costs: CostModel,
        trees: Sequence[RoundShape] = AUTO_TREES,
        *,
        explore_every: int = 16,
        acceptance: AcceptanceModel | None = None,
        learn_times: bool = True,
    ):
        self.trees = tuple(dict.fromkeys(as_shape(t) for t in trees))
        if not self.trees:
            raise ValueError("the adaptive policy needs at least one candidate tree")
        # learn_times=False: `costs` is authoritative (an injected model), observed round times are ignored.
        self.costs = RoundTimes(costs, self.trees, decay=0.9 if learn_times else 1.0)
        self.learn_times = learn_times
        self.explore_every = explore_every
        drafter_trees = [t for t in self.trees if t.drafts_with_drafter]
        lookups = [t for t in self.trees if t.drafts_by_lookup]
        self.lookups = tuple(lookups)
        # The candidates by family, as (index in `trees`, level widths its model sees), for `_rates` (every
        # round); the lookup forests apart from the chains (candidates once the text repeats, `rates`).
        self._plain = [i for i, t in enumerate(self.trees) if not t.speculates]
        self._drafters = [(i, t.model_widths) for i, t in enumerate(self.trees) if t.drafts_with_drafter]
        self._chains = [
            (i, t.model_widths) for i, t in enumerate(self.trees) if t.drafts_by_lookup and t.branches == 1
        ]
        self._forests = [
            (i, t.model_widths) for i, t in enumerate(self.trees) if t.drafts_by_lookup and t.branches > 1
        ]
        # the candidate the shadow's reports are learned as (`observe_shadow`)
        self._widest = max(lookups, key=lambda t: (t.branches, t.length), default=None)
        self.acceptance = acceptance or AcceptanceModel(max((t.depth for t in drafter_trees), default=1))
        self.calibration = YieldCalibration()
        # Lookup chains have a model and a calibration of their own (their acceptance is the text's
        # repetitiveness, not the drafter's skill); a chain's rank is always 0, no match is a miss at depth 1.
        self.lookup_acceptance = AcceptanceModel(
            max((t.length for t in lookups), default=1), prior_first=LOOKUP_PRIOR_FIRST
        )
        self.lookup_calibration = YieldCalibration(prior_drafts=LOOKUP_CALIBRATION_PRIOR)
        # The round that explores out of a plain streak (`choose`): the drafter's cheapest; the lookups' estimate
        # is kept by the shadow reports (`observe_shadow`), unless there is no drafter tree to explore.
        self._explore: RoundShape | None = (
            min(drafter_trees, key=lambda t: (t.nodes, t.depth))
            if drafter_trees
            else min(lookups, key=lambda t: t.depth, default=None)
        )
        self._plain_streak = 0
        self._interval = explore_every  # grows while explorations fail (`observe`)
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
        """A new generation: a new prompt is a new text. The acceptance estimates stay, the yield calibration's
        history is scaled by CARRY_OVER (this text's own first rounds correct it), the exploration schedule starts
        over."""
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

    def expected_tokens(self, widths: RoundShape) -> float:
        """The acceptance model's expected tokens for a candidate (its family's model), calibrated by its
        family's realised yield."""
        if not widths.speculates:
            return 1.0
        model, calibration, widths = self._family(widths)
        return 1.0 + (model.expected_tokens(widths) - 1.0) * calibration.ratio

    def _family(self, candidate: RoundShape) -> tuple[AcceptanceModel, YieldCalibration, tuple[int, ...]]:
        """A speculating candidate's acceptance model and yield calibration (the lookup chains', or the
        drafter's), and its level widths as that model sees them."""
        if candidate.drafts_by_lookup:
            return self.lookup_acceptance, self.lookup_calibration, candidate.model_widths
        return self.acceptance, self.calibration, candidate.model_widths

    def _learn(
        self, candidate: RoundShape, ranks: Sequence[int], *, start: int = 0, open: bool = False
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
        self._repeating |= candidate.drafts_by_lookup and bool(ranks)

    def rates(self, context_len: int) -> dict[RoundShape, float]:
        """Expected tokens per second of every candidate at this context length; a lookup forest (branches > 1)
        only once this call's text has repeated itself (a lookup hit, `_learn`): a forest's extra branches pay only
        on a text that repeats, and a call's first rounds are chosen from estimates carried over from other texts."""
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
        """What the policy believes at `context_len`, per candidate by name (`RoundShape.name`): expected tokens
        per round (calibrated), cost per round in ms (the measured table refined by observed round times, plus the
        switch's share while the ring is behind) and their
        ratio in tokens per ms: why it ran what it ran (a call's stats carry it: GenerationStats.policy)."""
        costs, rates = (
            dict(zip(self.trees, self._cost_list(context_len), strict=True)),
            self.rates(context_len),
        )
        return {
            t.name: {
                "expected_tokens": self.expected_tokens(t),
                "cost_ms": costs[t] * 1e3,
                "tokens_per_ms": rate / 1e3,
            }
            for t, rate in rates.items()
        }

    def best(self, context_len: int) -> RoundShape | None:
        """The candidate with the most expected tokens per second (first of equals: the cheaper end)."""
        best, top = None, 0.0
        for t, rate in zip(self.trees, self._rates(context_len), strict=True):
            if rate is not None and (best is None or rate > top):
                best, top = t, rate
        return best

    def choose(self, context_len: int) -> RoundShape | None:
        """`best`, except where it is no speculation: every `_interval`-th consecutive such round (at least the
        budget's floor, `_floor`) explores, with the drafter's cheapest round (`_explore`). In a plain streak the
        decision is re-checked every RECHECK_EVERY rounds or when the context bucket changes."""
        bucket = context_bucket(context_len)
        if self._decision is None or self._decision[0] != bucket or self._plain_streak % RECHECK_EVERY == 0:
            best = self.best(context_len)
            floor = 0 if _speculates(best) else self._floor(context_len)  # a plain streak's only
            self._decision = (bucket, best, floor)
        _, best, floor = self._decision
        if _speculates(best):
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
        self._ring_behind = best is None or not best.drafts_with_drafter
        return best

    def _floor(self, context_len: int) -> int:
        """The fewest plain rounds between explorations that keeps their extra cost within EXPLORE_BUDGET, priced
        at the exploring round's cost (decided with `best`, every RECHECK_EVERY rounds of a plain streak: the
        learned times change every round)."""
        costs = self.costs.costs(context_len)
        plain = costs[Plain()] if Plain() in costs else min(costs.values())
        explore = plain if self._explore is None else costs[self._explore]
        if self._explore is not None and self._explore.drafts_with_drafter:
            explore += self.switch_s  # out of a plain streak it catches the ring up
        if plain <= 0:
            return 1
        return max(1, math.ceil((explore - plain) / (EXPLORE_BUDGET * plain)))

    def observe(self, widths: RoundShape, ranks: Sequence[int], context_len: int | None = None) -> None:
        """A round's outcome: ranks of its accepted nodes (see AcceptanceModel.observe; a lookup chain's are all
        0). `context_len` (the round's) lets an exploration judge whether it changed the decision; without it,
        any accept counts. An accept reaching a plain streak (the speculating round before it, heard a round
        late) makes the streak decide again at its next round (`_hit`)."""
        if widths.speculates:
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
            pays = bool(ranks) if context_len is None else _speculates(self.best(context_len))
            self._interval = self.explore_every if pays else min(2 * self._interval, MAX_EXPLORE_EVERY)

    def observe_shadow(self, report: ShadowReport) -> None:
        """What the widest lookup candidate would have accepted at the root of a round that ran no lookup
        (`shadow.LookupShadow`: the drafts each of its branches matched so far, best match first; () when nothing
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
        instead of its next re-check (RECHECK_EVERY): an accept is what raises an estimate (a miss only lowers
        one), so the rounds after a text starts repeating itself are not left to plain decoding."""
        if self._decision is not None and not _speculates(self._decision[1]):
            self._decision = None

    def observe_time(
        self, widths: RoundShape, context_len: int, seconds: float, *, switched: bool = False
    ) -> None:
        """The wall time of a round just run (its whole cost: it ended with its host copy). `switched`: the ring
        caught up before it (a drafter round after plain or lookup rounds): what it took beyond the round's steady
        cost is the switch's (`switch_s`, see SWITCH_HORIZON), and the round's own estimate is left alone."""
        if not self.learn_times:
            return
        if switched:
            extra = max(0.0, seconds - self.costs.costs(context_len)[as_shape(widths)])
            self._switches += 1
            # a decayed mean (decay 0.9, as the rounds' times), the first observation taken whole
            weight = max(0.1, 1.0 / self._switches)
            self.switch_s += weight * (extra - self.switch_s)
            return
        self.costs.observe(widths, context_len, seconds)


def _speculates(candidate: RoundShape | None) -> bool:
    """Whether a chosen candidate drafts anything (None: every candidate was left out, as a plain step)."""
    return candidate is not None and candidate.speculates
