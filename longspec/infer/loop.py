"""The decode loop of one `generate_batch` call: choose a round shape, launch it, settle the oldest round in
flight, record what it showed, until every row has finished.

One round ahead: on static shapes the next round is launched before the last one's tokens reach the host (a
round's inputs, its roots, the cache lengths and the ring, are on the device), so the host's work between rounds
hides behind the device's. Eager rounds settle each round before the next. Everything is settled first where the
host's tokens are needed (a batch that shrinks), and nothing stays in flight when the newest round may end every
running row.

The policy decides round j from what rounds < j - 1 showed, whether round j - 1 is still in flight or not: the
round shapes, and so a sampled output, do not depend on how far ahead the rounds run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from longspec.infer.candidates import Plain, RoundShape
from longspec.infer.config import GenerationConfig
from longspec.infer.policy.shadow import ShadowReport
from longspec.infer.runner import Round, RoundRunner

__all__ = ["DecodeLoop", "Settled", "finished"]


@dataclass
class Settled:
    """What a settled round showed, until the policy is told (`DecodeLoop._observe`)."""

    index: int  # the call's round number
    candidate: RoundShape
    ranks: list[list[int]]  # per running row, the accepted nodes' ranks within their levels
    context_len: int  # the context length the round was chosen for
    seconds: float  # its wall time, between settles
    switched: bool  # the ring caught up before it
    shadowed: list[ShadowReport]  # the running rows' shadow lookups' reports


class DecodeLoop:
    """One `generate_batch` call's rounds, from the first root to the last settle, on `runner`'s state.
    `policy`: None for plain steps (method ar); `shadows`: per row, the shadow lookup (tree="auto" with lookups)."""

    def __init__(
        self,
        runner: RoundRunner,
        method,
        config: GenerationConfig,
        policy,
        slots,
        emitted: list[list[int]],
        stats,
        generator: torch.Generator,
        clock,
        shadows=None,
        drafter=None,
    ):
        self.runner, self.method, self.config, self.policy = runner, method, config, policy
        self.shadows, self.drafter = shadows, drafter
        self.slots, self.emitted, self.stats = slots, emitted, stats
        self.generator, self.clock = generator, clock
        self.static = config.static
        self.lookahead = self.static
        self.inflight: list[Round] = []
        self.launched = 0  # rounds launched so far (the next one's index)
        # A plain or lookup round leaves the drafter's ring behind (its tokens only enter the history); the next
        # drafter round catches it up first (on the device, nothing settled).
        self.ring_behind = False
        self.settled_at = time.perf_counter()
        self.pending: list[Settled] = []  # settled rounds the policy has not been told of yet
        # the host's context length after each settled round (index 0: the prompt)
        self.context_after = [max(runner.cache.lengths)]

    def run(self, roots: torch.Tensor) -> None:
        """Decode until every row has finished."""
        slots = self.slots
        with self.runner.cache.lead_on_device():
            while True:
                launched = False
                if any(slots.active):  # the host's view: a row that ended in a round in flight still runs
                    roots, launched = self._launch_next(roots), True
                while len(self.inflight) > (1 if self.lookahead and launched else 0):
                    self._settle()
                if self.inflight and all(
                    len(self.emitted[row]) + self.inflight[-1].depth + 1 >= self.config.max_new_tokens
                    for _, row in slots.running()
                ):
                    self._settle()
                if self.static and slots.shrink_due() and self._tail() >= self.config.shrink_min_tokens:
                    # finished rows leave the batch (GenerationConfig.shrink_min_tokens), nothing in flight
                    while self.inflight:
                        self._settle()
                    if (index := slots.shrink()) is not None:
                        roots = self.runner.select_rows(index, roots, self.drafter)
                if not self.inflight and not any(slots.active):
                    break
        self._observe(self.launched + 1)  # the last rounds' lessons, for the policy's next call

    def _tail(self) -> int:
        """The most tokens a running row may still generate (its max_new_tokens budget, as the host sees it)."""
        return max(self.config.max_new_tokens - len(self.emitted[row]) for _, row in self.slots.running())

    def _launch_next(self, roots: torch.Tensor) -> torch.Tensor:
        """Choose and launch the next round (after the ring's catch-up, if it needs one); returns the next roots."""
        drafter_round = self.method.needs_drafter
        candidate, context_len = self._choose(self.launched) if self.policy is not None else (Plain(), 0)
        spent, switched = 0.0, False
        if drafter_round and candidate.drafts_with_drafter and self.ring_behind:
            switched = True
            start = time.perf_counter()
            self.runner.catch_up(static=self.static, capture=self.config.cuda_graphs)
            self.ring_behind = False
            # The round that needed the catch-up is charged for it (the policy learns a switch's cost apart);
            # a round in flight is timed from the later of the last settle and its own launch: both move past it.
            spent = time.perf_counter() - start
            self.settled_at += spent
            for flying in self.inflight:
                flying.launched_at += spent
        rnd, roots = self.runner.launch(
            self.method, candidate, roots, self.config, self.generator, static=self.static, clock=self.clock,
            slots=self.slots, context_len=context_len,
        )  # fmt: skip
        rnd.extra_s, rnd.switched = spent, switched
        rnd.index, self.launched = self.launched, self.launched + 1
        self.inflight.append(rnd)
        self.ring_behind |= drafter_round and not candidate.drafts_with_drafter
        return roots

    def _settle(self) -> None:
        """The oldest round in flight: its tokens to the host (the round's one host sync), then the host's
        bookkeeping: stats, stops, what the policy will observe."""
        slots = self.slots
        rnd = self.inflight.pop(0)
        new_tokens, path_slots = self.runner.settle(rnd)
        # In flight, a round's time is the gap between two settles (or since its launch, if later).
        seconds = time.perf_counter() - max(self.settled_at, rnd.launched_at) + rnd.extra_s
        self.settled_at = time.perf_counter()
        ranks = [rnd.candidate.level_ranks(path_slots[slot]) for slot, _ in slots.running()]
        shadowed = []
        if self.shadows is not None:
            for slot, row in slots.running():
                # a lookup round's own outcome is in `ranks`; it ends the row's shadow (`LookupShadow.extend`)
                shadowed += self.shadows[row].extend(
                    new_tokens[slot], shadow=not rnd.candidate.drafts_by_lookup
                )
        self.pending.append(
            Settled(rnd.index, rnd.candidate, ranks, rnd.context_len, seconds, rnd.switched, shadowed)
        )
        self.context_after.append(max(self.runner.cache.lengths))
        tree = rnd.candidate.name if self.method.needs_drafter else None
        for slot, row in slots.running():  # rows that finished in an earlier round ignore this one
            self.stats[row].record_round(len(new_tokens[slot]) - 1, tree, seconds)
            self.emitted[row].extend(new_tokens[slot])
            slots.active[slot] = not finished(self.emitted[row], self.config, new=new_tokens[slot])

    def _choose(self, index: int) -> tuple[RoundShape, int]:
        """Round `index`'s shape and the context length it is chosen for, from rounds < index - 1."""
        self._observe(index)
        context_len = self.context_after[max(0, index - 1)]
        return self.policy.choose(context_len), context_len

    def _observe(self, index: int) -> None:
        """Give the policy what settled rounds < index - 1 showed."""
        if self.policy is None:
            return
        while self.pending and self.pending[0].index <= index - 2:
            done = self.pending.pop(0)
            # A call's first round pays the call's start (nothing in flight its launch could overlap): learned as
            # its shape's cost, it would price whatever opens the calls above its steady rounds.
            if done.index:
                self.policy.observe_time(
                    done.candidate, done.context_len, done.seconds, switched=done.switched
                )
            for row_ranks in done.ranks:
                self.policy.observe(done.candidate, row_ranks, done.context_len)
            for report in done.shadowed:
                self.policy.observe_shadow(report)


def finished(emitted: list[int], config: GenerationConfig, *, new: list[int]) -> bool:
    """Stop once max_new_tokens are out or one of the `new` tokens is an EOS."""
    return len(emitted) >= config.max_new_tokens or any(t in config.eos_token_ids for t in new)
