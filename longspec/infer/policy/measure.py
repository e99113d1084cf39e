"""tree="auto" on an engine: which policy a call runs, and the seconds of one real round per candidate and
context bucket, measured on this device before any timed decode (through the engine's `runner.RoundRunner`,
launched one ahead as a call runs them).

`engine` below is a `SpeculativeEngine`, passed in by the engine itself: this module does not import it.
"""

from __future__ import annotations

import time

import torch

from longspec.infer.candidates import RoundShape
from longspec.infer.config import GenerationConfig
from longspec.infer.methods import get_method
from longspec.infer.policy import cost_cache
from longspec.infer.policy.adaptive import AdaptivePolicy, FixedPolicy
from longspec.infer.policy.costs import MeasuredCosts, context_bucket
from longspec.infer.timing import PhaseClock

__all__ = ["choose_policy", "cost_mode", "measure_round_costs"]


def choose_policy(
    engine, config: GenerationConfig, prompt_len: int, *, batch_size: int = 1
) -> FixedPolicy | AdaptivePolicy:
    """The call's tree policy: the user's fixed tree, or the engine's adaptive policy for this decoding mode and
    batch size (kept across calls in `engine.policies`), on the engine's injected cost model or else on the
    round costs measured for this mode (`engine.cost_tables`; buckets it lacks are measured now, at
    `batch_size` rows: a round's cost grows with the batch, a big tree's fastest)."""
    fixed = config.fixed_tree
    if fixed is not None:
        return FixedPolicy(fixed)
    costs = engine.costs
    if costs is None:
        costs = measure_round_costs(
            engine, config, [prompt_len, prompt_len + config.max_new_tokens], batch_size=batch_size
        )
    key = (
        config.candidates,
        config.temperature > 0,
        config.sampling_rule,
        config.cuda_graphs,
        batch_size,
        id(costs),
    )
    if key not in engine.policies:
        # Measured costs are refined by the rounds' observed times; an injected cost model is taken as given.
        measured = isinstance(costs, MeasuredCosts)
        engine.policies[key] = AdaptivePolicy(costs, config.candidates, learn_times=measured)
    policy = engine.policies[key]
    policy.start()
    return policy


def cost_mode(config: GenerationConfig, batch_size: int) -> tuple:
    """What a round's cost depends on besides tree and context: its acceptance rule, static shapes, CUDA
    graphs, and the rows it runs. One measured table per mode (`engine.cost_tables`)."""
    return (config.temperature > 0, config.sampling_rule, config.static, config.cuda_graphs, batch_size)


@torch.no_grad()
def measure_round_costs(
    engine, config: GenerationConfig, context_lens, *, reps: int = 4, batch_size: int = 1
) -> MeasuredCosts:
    """Measure, on the engine's device, the seconds of one real round (propose + verify + accept + commit, on the
    static / captured path when the config asks for it, launched one ahead as a call runs them: `_time_rounds`)
    of every tree="auto" candidate, per context bucket between min(context_lens) and max(context_lens), at
    `batch_size` rows (every row at the bucket's length; the cache's content does not change a round's cost).
    Only missing buckets are measured; the cache and ring buffer are reset after. First use of a shape builds
    (captures) its steps here, outside any timed decode; on static shapes, a table with nothing missing whose
    steps were dropped since (`TargetStep.epoch`: the cache grew) runs every candidate once, untimed, to build
    them again. A candidate whose first two timed blocks cost more than _HOPELESS_MARGIN x (depth + 1) plain
    rounds can never beat plain decoding: its further reps are skipped, and so is every candidate containing it
    that such a cost also rules out (`_hopeless`; its cost is then recorded as the contained one's, a lower
    bound). Returns the mode's table (`cost_mode`), kept in `engine.cost_tables` for later calls."""
    if engine.drafter is None:
        raise ValueError("measuring longspec round costs needs a drafter")
    static = config.static
    mode = cost_mode(config, batch_size)
    if mode not in engine.cost_tables:  # this process's first call in the mode: the table on disk, if any
        stored = (
            None if config.remeasure_costs else cost_cache.load_costs(cost_cache.cache_path(engine, mode))
        )
        engine.cost_tables[mode] = stored or MeasuredCosts()
    costs = engine.cost_tables[mode]
    low, high = context_bucket(min(context_lens)), context_bucket(max(context_lens))
    buckets = [1 << e for e in range(low.bit_length() - 1, high.bit_length())]
    candidates = config.candidates
    missing = costs.missing(candidates, buckets)
    built = not static or engine.steps_built.get(mode) == engine.target_step.epoch
    if not missing and built:
        return costs
    # Room for a block: each round commits at most depth + 1 tokens, the last one's tree is pending on top.
    room = _BLOCK * (1 + max(c.depth for c in candidates)) + config.max_round_nodes
    engine.reserve(max(context_lens) + room, batch_size)
    generator = torch.Generator(device=engine.device).manual_seed(0)
    root = torch.zeros(batch_size, dtype=torch.long, device=engine.device)
    clock = PhaseClock(engine.device)
    engine.drafter_cache.reset()
    # Nothing missing but the steps were dropped since: one untimed rep of every candidate builds them again.
    for bucket in missing or buckets[:1]:
        length = max(1, min(bucket, engine.cache.max_len - room))
        times: dict = {w: [] for w in candidates}

        # The fastest rep kept (the first is untimed: lazy init, autotuning, graph capture), the later reps
        # interleaved over the candidates: another process on the same cores only ever adds time, and unevenly.
        def timed(widths, length=length):
            engine.cache.length = length
            return _time_rounds(engine, widths, root, config, generator, static, clock)

        if not missing:  # build every step once, untimed
            for widths in candidates:
                timed(widths)
        else:
            # Rep 0 (untimed) and reps 1-2 candidate by candidate, smallest first, so that plain decoding's cost
            # is known before any candidate is judged against it; the later reps interleaved over the survivors.
            bounds: dict = {}
            plain = None
            for widths in sorted(candidates, key=lambda c: c.nodes):
                bound = _hopeless(widths, bounds, plain)
                if bound is not None:
                    bounds[widths] = bound
                    continue
                timed(widths)
                times[widths] += [timed(widths) for _ in range(min(2, reps))]
                if not widths.speculates:
                    plain = min(times[widths])
                elif _rules_out(min(times[widths]), widths, plain):
                    bounds[widths] = min(times[widths])
            for _ in range(reps - 2):
                for widths in candidates:
                    if widths not in bounds:
                        times[widths].append(timed(widths))
            for widths in candidates:
                costs.seconds[(bucket, widths)] = bounds[widths] if widths in bounds else min(times[widths])
    if missing:
        cost_cache.save_costs(cost_cache.cache_path(engine, mode), costs)
    # The ring's catch-up after plain rounds is a step of its own: built (captured) here too, not in a timed call.
    engine.runner.catch_up(static=static, capture=config.cuda_graphs)
    engine.cache.reset()
    engine.drafter_cache.reset()
    engine.steps_built[mode] = engine.target_step.epoch
    return costs


_BLOCK = 4  # rounds of one tree run back to back per timing


# A candidate is ruled out only past this multiple of its (depth + 1) plain rounds, on the faster of two timed
# blocks: a busy machine's one slow block must not rule out a tree for the engine's lifetime.
_HOPELESS_MARGIN = 1.5


def _rules_out(cost: float, candidate: RoundShape, plain: float | None) -> bool:
    """Whether a round cost of `cost` (or more) rules `candidate` out: over _HOPELESS_MARGIN x (depth + 1) plain
    rounds, the most the candidate could emit per round."""
    return plain is not None and cost > _HOPELESS_MARGIN * (candidate.depth + 1) * plain


def _hopeless(candidate: RoundShape, bounds: dict, plain: float | None) -> float | None:
    """A lower bound of `candidate`'s round cost that already rules it out, or None: the largest cost of a
    ruled-out candidate it contains (it does all of that one's work and more) that rules it out too."""
    costs = [
        cost
        for small, cost in bounds.items()
        if _rules_out(cost, candidate, plain) and candidate.contains(small)
    ]
    return max(costs) if costs else None


def _time_rounds(engine, widths, root, config, generator, static: bool, clock) -> float:
    """Seconds per round of `widths` as `generate_batch` runs them: a block of rounds, each launched before the
    previous one settles (on static shapes: the host's work between rounds overlaps the device's), timed
    between settles once the block is under way, so the first launch's host work is not counted; eager rounds
    settle one by one, as they do in a call."""
    lookahead, runner, method = static, engine.runner, get_method("longspec", runner="engine")
    inflight, marks = [], []
    with engine.cache.lead_on_device():
        for _ in range(_BLOCK):
            rnd, root = runner.launch(method, widths, root, config, generator, static=static, clock=clock)
            inflight.append(rnd)
            while len(inflight) > (1 if lookahead else 0):
                runner.settle(inflight.pop(0))
                marks.append(time.perf_counter())
        while inflight:
            runner.settle(inflight.pop(0))
            marks.append(time.perf_counter())
    return (marks[-2] - marks[0]) / (len(marks) - 2)
