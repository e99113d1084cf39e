"""Host time of tree="auto"'s policy (`longspec.infer.policy.AdaptivePolicy`) per decode round on this machine's
CPU: what the engine asks of it between two rounds (`loop.DecodeLoop`: the time, outcome and shadow reports of
the round two back, then the next round's choice). On the GPU a round costs ~1.1-1.2 ms and this work sits
between two of them: every 10 us of it is ~1% of decoding speed.

    PYTHONPATH=. python benchmarks/policy_host.py [--mixes plain drafter lookup mix] [--rounds 4000] [--repeats 7]

Each mix is a seeded simulated text played against the policy, on a stub cost table (a `MeasuredCosts` of GPU-like
round costs per context bucket; each round's observed time is its entry, jittered):
- plain: the drafter accepts nothing and the text never repeats: plain rounds, a shadow report each, explorations;
- drafter: the drafter accepts often (a rank drawn per depth): its trees run, the shadow reports misses;
- lookup: the text quotes itself at length: lookup chains run; the shadow's long matches are heard in two pieces;
- mix: the three in turn, 250 rounds each, a new call (`start`) every 500 rounds.
The policy's calls are recorded once, then replayed on fresh policies and timed (their choices checked against the
recording, so each repeat times the same work): a mix's figure is the median over --repeats of the mean
microseconds per round, with the cyclic garbage collector off as in the engine's decode loop. Writes
$OUT/policy_host.json (or --json) when given.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass

from longspec.atomic import write_json_atomic
from longspec.infer.candidates import AUTO_LOOKUPS, AUTO_TREES
from longspec.infer.graphs import no_gc
from longspec.infer.policy import AdaptivePolicy, MeasuredCosts
from longspec.infer.policy.shadow import ShadowReport
from longspec.provenance import run_info

CANDIDATES = AUTO_TREES + AUTO_LOOKUPS
BUCKETS = [1024 << i for i in range(6)]  # 1K..32K: every context a mix reaches is measured
PLAIN_S = 1.15e-3  # a plain round at 1K on the GPU
CATCH_UP_S = 0.25e-3  # the drafter ring's catch-up before a drafter round that follows plain or lookup rounds
MIX_PHASE = 250  # rounds per phase of the "mix"
CALL_ROUNDS = 500  # rounds per call of the "mix"


@dataclass(frozen=True)
class Text:
    """What a phase's text does: `skill`, the chance the drafter ranks the target's token among its first few at
    a depth (else far below any width); `repeat`, the chance a root's lookup matches, and the mean run it then
    matches."""

    skill: float
    repeat: float
    run: float = 6.0


TEXTS = {
    "plain": Text(skill=0.0, repeat=0.0),
    "drafter": Text(skill=0.8, repeat=0.0),
    "lookup": Text(skill=0.1, repeat=0.85, run=10.0),
}
MIXES = {name: [name] for name in TEXTS} | {"mix": ["plain", "drafter", "lookup"]}


def cost_table(seed: int = 0) -> MeasuredCosts:
    """GPU-like round costs: a plain round ~1.15 ms growing slowly with the context, a drafter round its draft
    forward plus its nodes, a lookup its match plus its chain's nodes; each entry jittered 2%."""
    rng = random.Random(seed)
    seconds = {}
    for bucket in BUCKETS:
        plain = PLAIN_S * (1.0 + 0.02 * math.log2(bucket / BUCKETS[0]))
        for c in CANDIDATES:
            if c.drafts_by_lookup:
                factor = 1.15 + 0.004 * (c.nodes - 1)
            else:
                factor = 1.3 + 0.004 * (c.nodes - 1) if c.speculates else 1.0
            seconds[(bucket, c)] = plain * factor * rng.uniform(0.98, 1.02)
    return MeasuredCosts(seconds=seconds)


def drafter_ranks(rng: random.Random, widths: tuple[int, ...], text: Text) -> list[int]:
    """A drafter round's accepted ranks: per depth, a small rank with chance `skill` (else a miss), accepted
    while it is below the level's width."""
    ranks = []
    for width in widths:
        rank = min(int(rng.expovariate(1.0)), 31) if rng.random() < text.skill else 1 << 10
        if rank >= width:
            break
        ranks.append(rank)
    return ranks


def lookup_match(rng: random.Random, text: Text) -> tuple[int, ...]:
    """What each of the widest lookup's branches matches at a root (best first; () when nothing was there)."""
    if rng.random() >= text.repeat:
        return () if rng.random() < 0.5 else (0,)
    branches = max(c.branches for c in AUTO_LOOKUPS)
    longest = min(16, 1 + int(rng.expovariate(1.0 / text.run)))
    return (longest,) + tuple(rng.randint(0, longest) for _ in range(branches - 1))


def shadow_reports(rng: random.Random, matched: tuple[int, ...]) -> tuple[list, list]:
    """A shadow lookup's reports: (this round's, the next round's). A long match is heard in two pieces, as the
    engine's shadow reports a run while it happens: an open report of its first half, then the close."""
    longest = max(matched, default=0)
    if longest < 4 or rng.random() < 0.5:
        return [ShadowReport(matched)], []
    half = longest // 2
    first = ShadowReport(tuple(min(m, half) for m in matched), 0, False)
    return [first], [ShadowReport(matched, half, True)]


def phases(mix: str, rounds: int) -> list[Text]:
    texts = MIXES[mix]
    return [TEXTS[texts[(i // MIX_PHASE) % len(texts)]] for i in range(rounds)]


def record(mix: str, rounds: int, seed: int) -> tuple[list, Counter]:
    """The policy's calls over `rounds` of `mix` ((function, args, kwargs, result) in order, as the engine makes them:
    round i is chosen after what rounds < i - 1 showed; a call's first round teaches no time) and the rounds
    by kind."""
    rng, costs = random.Random(seed), cost_table(seed)
    policy = AdaptivePolicy(costs, CANDIDATES)
    calls, kinds = [], Counter()

    def call(fn, *args, **kwargs):
        result = fn(policy, *args, **kwargs)
        calls.append((fn, args, kwargs, result))
        return result

    lessons: deque = deque()  # (first of its call, widths, ranks, context, seconds, switched, reports)
    later: list = []  # the shadow's reports due at the next round (a match heard in pieces)

    def hear(lesson):
        first, widths, ranks, context, seconds, switched, reports = lesson
        if not first:
            call(AdaptivePolicy.observe_time, widths, context, seconds, switched=switched)
        call(AdaptivePolicy.observe, widths, ranks, context)
        for report in reports:
            call(AdaptivePolicy.observe_shadow, report)

    context, ring_behind = 1000, False
    for i, text in enumerate(phases(mix, rounds)):
        if mix == "mix" and i and i % CALL_ROUNDS == 0:
            while lessons:  # the call's last rounds are heard at its end
                hear(lessons.popleft())
            call(AdaptivePolicy.start)
            context, ring_behind = rng.randint(800, 3000), False
        if len(lessons) == 2:
            hear(lessons.popleft())
        widths = call(AdaptivePolicy.choose, context)
        matched = lookup_match(rng, text)
        if widths.drafts_by_lookup:
            ranks, reports = widths.ranks(matched), []
            kinds["lookup"] += 1
        else:
            ranks = drafter_ranks(rng, widths.model_widths, text)
            reports, due = shadow_reports(rng, matched)
            reports, later = later + reports, due
            kinds["drafter" if widths.speculates else "plain"] += 1
        switched = widths.drafts_with_drafter and ring_behind
        ring_behind = not widths.drafts_with_drafter
        seconds = costs.cost(widths, context) * rng.uniform(0.95, 1.1) + (CATCH_UP_S if switched else 0.0)
        first = i == 0 or (mix == "mix" and i % CALL_ROUNDS == 0)
        lessons.append((first, widths, ranks, context, seconds, switched, reports))
        context += 1 + len(ranks)
    return calls, kinds


def replay(calls: list, seed: int) -> float:
    """Seconds the recorded calls take on a fresh policy (on the same cost table); its choices must be the
    recording's, so what is timed is the same work."""
    policy = AdaptivePolicy(cost_table(seed), CANDIDATES)
    with no_gc():
        start = time.perf_counter()
        results = [fn(policy, *args, **kwargs) for fn, args, kwargs, _ in calls]
        seconds = time.perf_counter() - start
    if results != [result for *_, result in calls]:
        raise RuntimeError("the replayed policy chose otherwise than the recording")
    return seconds


def time_mix(mix: str, rounds: int, repeats: int, seed: int) -> dict:
    calls, kinds = record(mix, rounds, seed)
    per_round = [replay(calls, seed) / rounds * 1e6 for _ in range(repeats)]
    return {
        "mix": mix,
        "rounds": rounds,
        "us_per_round": statistics.median(per_round),
        "us_per_round_min": min(per_round),
        "calls_per_round": len(calls) / rounds,
        "rounds_by_kind": dict(sorted(kinds.items())),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixes", nargs="+", choices=list(MIXES), default=list(MIXES))
    parser.add_argument("--rounds", type=int, default=4000, help="rounds per mix")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="output path when $OUT is not set")
    args = parser.parse_args(argv)
    rows = []
    for mix in args.mixes:
        row = time_mix(mix, args.rounds, args.repeats, args.seed)
        rows.append(row)
        kinds = ", ".join(f"{kind} {n}" for kind, n in row["rounds_by_kind"].items())
        print(
            f"{mix:>8}: {row['us_per_round']:6.1f} us per round (min {row['us_per_round_min']:5.1f}; "
            f"{row['calls_per_round']:.2f} calls per round; rounds: {kinds})",
            flush=True,
        )
    out = os.path.join(os.environ["OUT"], "policy_host.json") if os.environ.get("OUT") else args.json
    if out:
        write_json_atomic(out, {**run_info(), "args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
