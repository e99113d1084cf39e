"""Speculative generation on a static target KV cache: LongSpec tree drafting, hybrid verification, lossless
acceptance; the same engine also runs plain autoregressive decoding ("ar") and prompt-lookup drafting ("pld").

Shape legend: B sequences decoded together, T new tokens in one target forward, N tree nodes, n committed tokens
(cache length, per sequence), W drafter window, V vocabulary, Dm model width, H / Hkv query / key-value heads,
D head dim.

One round (docs/ALGORITHM.md §4), starting from the root = the last token emitted, at position n, not yet in any cache:
  1. draft:  a dynamic-beam tree of N nodes (root + sum(widths)); every node cross-attends to the target's
             last-layer K/V < n and self-attends to the drafter's ring buffer (committed tokens in its window)
             plus its tree ancestors; or a prompt-lookup chain (method pld, and tree="auto"'s `Lookup` rounds):
             n-gram drafts from the device token history (`pld.device_lookup`), no drafter;
  2. verify: ONE target forward over the N nodes at positions n + depth; per layer the new K/V go to the cache's
             pending slots and attention = merge(cache part unmasked, tree part under the ancestor mask);
  3. accept: greedy or lossless sampling (longspec.infer.accept), on the device with fixed shapes -> accepted
             path (padded) + its length + bonus token;
  4. commit: the path's K/V move into place for every layer (no re-feeding); the path's tokens enter the
             token history and the drafter's ring buffer takes their self-attention K/V (a plain or lookup round
             of tree="auto" only records them: the ring catches up from the history before the next draft); the
             committed lengths advance on the device; the bonus becomes the next root. The emitted tokens, the
             path and its length start ONE asynchronous copy to the host.
Steps 1-4 read nothing on the host (`_launch`): on static shapes they are ONE static step (with cuda_graphs, one
graph launch per round); the round settles (`_finish`: the round's one host sync) later.
On static shapes the next round is launched before the last one settles: the host's work between rounds
(stats, stops, the tree policy) runs while the device computes.
Every round of one tree shape has the same shapes (N fixed, padded), which is what CUDA-graph capture needs; with
tree="auto" (longspec.infer.policy) the shape may change between rounds: one static / captured step per shape.

A batch (`generate_batch`) runs the same round with one tree per sequence: every sequence has its own position,
cache length and ring-buffer row; the trees share one layout (widths) and are verified in ONE target forward
[B, N]; each sequence commits its own accepted path (ragged counts). A sequence that has finished stays in the
batch, frozen (it commits nothing more and its output is ignored), so the shapes stay those of the batch; on
static shapes a batch runs in its power-of-two bucket and moves to the smaller one once half of it has finished,
if the rest still has `shrink_min_tokens` to go (`slots.BatchSlots`, GenerationConfig). `generate` is the batch of one.

This module strings the rounds together (`generate_batch` -> `_launch` / `_finish`) and accepts; the pieces
live by side:
`draft_step.DraftStep` (the drafter's ring buffer and the draft tree), `target_step.TargetStep` (the target's
cache, prefill and verify forward, the static steps), `history.TokenHistory` (the committed tokens by position),
`pld` (the device lookup, and the host's shadow lookup the policy learns from), `round_costs` (tree="auto": the
policy and the measured round costs), `timing` (phase clocks).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import warnings
from dataclasses import dataclass, field

import torch

from longspec.infer.accept import (
    emitted_tokens,
    greedy_path,
    sample_chain_path,
    sample_path,
    sample_token,
    target_distribution,
    uniforms,
)
from longspec.infer.cache import StaticKVCache
from longspec.infer.config import DEFAULT_TREE_WIDTHS, GenerationConfig
from longspec.infer.draft_step import DraftStep
from longspec.infer.graphs import no_gc
from longspec.infer.history import TokenHistory
from longspec.infer.methods import get_method
from longspec.infer.pld import LookupShadow, lookup_tree
from longspec.infer.policy import AdaptivePolicy, FixedPolicy, MeasuredCosts
from longspec.infer.round_costs import choose_policy
from longspec.infer.round_costs import measure_round_costs as _measure_round_costs
from longspec.infer.slots import BatchSlots, bucket, compaction
from longspec.infer.stats import GenerationStats
from longspec.infer.target_step import TargetStep, prefill_slots
from longspec.infer.timing import PhaseClock, now, timer
from longspec.infer.tree import (
    DraftTree,
    ForestParts,
    Lookup,
    TreeLayout,
    is_drafter_tree,
    tree_name,
)
from longspec.kernels.chain_accept import chain_packed, greedy_chain_packed
from longspec.kernels.path_commit import commit_path
from longspec.kernels.row_argmax import row_argmax
from longspec.modules.rope import exact_positions, longrope_long

# GenerationConfig and DEFAULT_TREE_WIDTHS live in longspec.infer.config; the engine is their public home.
__all__ = ["GenerationConfig", "GenerationResult", "SpeculativeEngine", "DEFAULT_TREE_WIDTHS", "cache_slots"]


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens (prompt excluded), truncated at EOS / max_new_tokens
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class _Round:
    """A launched round, until it settles: what the host needs to finish it."""

    widths: tuple[int, ...] | Lookup  # its tree (() = a plain step) or lookup chain
    depth: int  # levels drafted (the packed output is [B, 2 (depth + 1) + 1])
    active: list[bool]  # the rows it commits for (the host's view at launch)
    packed: torch.Tensor  # emitted tokens, path, count per row: on the host once `copied` has completed
    copied: torch.cuda.Event | None  # the copy's event (None: already on the host)
    launched_at: float
    context_len: int  # the context length the policy chose it for (its bucket)
    index: int = 0  # the call's round number
    extra_s: float = 0.0  # host seconds spent for it before its launch (the ring's catch-up): charged to it
    switched: bool = (
        False  # the ring caught up before it: its time includes the switch (policy.SWITCH_HORIZON)
    )


class _DecodeLoop:
    """One `generate_batch` call's rounds, from the first root to the last settle.

    One round ahead: on static shapes the next round is launched before the last one's tokens reach the host (a
    round's inputs, its roots, the cache lengths and the ring, are on the device), so the host's work between
    rounds hides behind the device's (PLD too: its lookup reads the device history). Eager rounds gain nothing:
    they settle each round before the next. Everything is settled first where the host's
    tokens are needed (a batch that shrinks), and nothing stays in flight when the newest round may end every
    running row (no wasted round). The ring's catch-up needs no host token: it is launched like a round.

    The policy decides round j from what rounds < j - 1 showed (acceptance, times, context length), whether round
    j - 1 is still in flight or not: the trees, and so a sampled output, do not depend on how far ahead the
    rounds run (static shapes or eager, with or without graphs)."""

    def __init__(self, engine, method, config, policy, slots, emitted, stats, generator, clock, shadows=None):
        self.engine, self.method, self.config, self.policy = engine, method, config, policy
        # Per row, what a lookup chain would have accepted at the rounds that ran none (tree="auto" with lookups:
        # `pld.LookupShadow`), given to the policy with the rounds' other lessons.
        self.shadows = shadows
        self.spec = get_method(method, runner="engine")
        self.slots, self.emitted, self.stats = slots, emitted, stats
        self.generator, self.clock = generator, clock
        self.static = config.static
        self.lookahead = self.static
        self.inflight: list[_Round] = []
        self.launched = 0  # rounds launched so far (the next one's index)
        # A plain or lookup round leaves the drafter's ring behind (its tokens only enter the history); the next
        # drafting round catches it up first (`DraftStep.catch_up`, on the device, nothing settled).
        self.ring_behind = False
        self.settled_at = time.perf_counter()
        # What settled rounds showed, not yet given to the policy: (round, widths, ranks per running row,
        # context_len, seconds, whether the ring caught up before it, shadow lookups' reports); and the host's
        # context length after each settled round (index 0: the prompt).
        self.lags: list[tuple] = []
        self.context_after = [max(engine.cache.lengths)]

    def run(self, roots: torch.Tensor) -> None:
        """Decode until every row has finished."""
        engine, slots = self.engine, self.slots
        with engine.cache.lead_on_device():
            while True:
                launched = False
                if any(slots.active):  # the host's view: a row that ended in a round in flight still runs
                    roots, launched = self._launch_next(roots)
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
                        roots = engine._select_slots(index, roots)
                if not self.inflight and not any(slots.active):
                    break
        self._observe(self.launched + 1)  # the last rounds' lessons, for the policy's next call

    def _tail(self) -> int:
        """The most tokens a running row may still generate (its max_new_tokens budget, as the host sees it)."""
        return max(self.config.max_new_tokens - len(self.emitted[row]) for _, row in self.slots.running())

    def _launch_next(self, roots: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Choose and launch the next round (after the ring's catch-up, if it needs one); returns the next roots
        and whether a round was launched."""
        engine, spec = self.engine, self.spec
        widths, context_len = self._choose(self.launched) if self.policy is not None else ((), 0)
        spent, switched = 0.0, False
        if spec.needs_drafter and is_drafter_tree(widths) and self.ring_behind:
            switched = True
            start = time.perf_counter()
            engine._catch_up(static=self.static, capture=self.config.cuda_graphs)
            self.ring_behind = False
            # The round that needed the catch-up is charged for it, not the round in flight while it was launched:
            # the policy then sees what a switch to the drafter costs (`switched`: it learns that apart from the
            # tree's steady cost, policy.SWITCH_HORIZON). (On a GPU the catch-up's device time
            # falls between the two rounds' settles by itself; what is charged here is its host time.)
            # A round in flight is timed from the later of the last settle and its own launch: both move past it.
            spent = time.perf_counter() - start
            self.settled_at += spent
            for flying in self.inflight:
                flying.launched_at += spent
        rnd, roots = engine._launch(
            self.method, widths, roots, self.config, self.generator, static=self.static, clock=self.clock,
            slots=self.slots, context_len=context_len,
        )  # fmt: skip
        rnd.extra_s, rnd.switched = spent, switched
        rnd.index, self.launched = self.launched, self.launched + 1
        self.inflight.append(rnd)
        self.ring_behind |= spec.needs_drafter and not is_drafter_tree(widths)
        return roots, True

    def _settle(self) -> None:
        """The oldest round in flight: its tokens to the host (the round's one host sync), then the host's
        bookkeeping: stats, stops, what the policy will observe."""
        engine, slots = self.engine, self.slots
        rnd = self.inflight.pop(0)
        new_tokens, path_slots = engine._finish(rnd)
        # In flight, a round's time is the gap between two settles (or since its launch, if later).
        seconds = time.perf_counter() - max(self.settled_at, rnd.launched_at) + rnd.extra_s
        self.settled_at = time.perf_counter()
        ranks = [_level_ranks(rnd.widths, path_slots[slot]) for slot, _ in slots.running()]
        shadowed = []
        if self.shadows is not None:
            for slot, row in slots.running():
                # a lookup round's own outcome is in `ranks`; it ends the row's shadow (`LookupShadow.extend`)
                lookup = isinstance(rnd.widths, Lookup)
                shadowed += self.shadows[row].extend(new_tokens[slot], shadow=not lookup)
        self.lags.append((rnd.index, rnd.widths, ranks, rnd.context_len, seconds, rnd.switched, shadowed))
        self.context_after.append(max(engine.cache.lengths))
        tree = tree_name(rnd.widths) if self.spec.needs_drafter else None
        for slot, row in slots.running():  # rows that finished in an earlier round ignore this one
            self.stats[row].record_round(len(new_tokens[slot]) - 1, tree, seconds)
            self.emitted[row].extend(new_tokens[slot])
            slots.active[slot] = not _finished(self.emitted[row], self.config, new=new_tokens[slot])

    def _choose(self, index: int) -> tuple[tuple[int, ...] | Lookup, int]:
        """Round `index`'s tree and the context length it is chosen for, from rounds < index - 1."""
        self._observe(index)
        context_len = self.context_after[max(0, index - 1)]
        return self.policy.choose(context_len), context_len

    def _observe(self, index: int) -> None:
        """Give the policy what settled rounds < index - 1 showed."""
        if self.policy is None:
            return
        while self.lags and self.lags[0][0] <= index - 2:
            round_index, widths, ranks, context_len, seconds, switched, shadowed = self.lags.pop(0)
            # A call's first round pays the call's start (nothing in flight its launch could overlap): in a GPU
            # evaluation's round logs 0.2-0.4 ms over its tree's steady round, in every call (docs/BENCHMARKS.md).
            # Learned as the tree's cost, it would price whatever tree opens the calls above its steady rounds.
            if round_index:
                self.policy.observe_time(widths, context_len, seconds, switched=switched)
            for row_ranks in ranks:
                self.policy.observe(widths, row_ranks, context_len)
            for report in shadowed:
                self.policy.observe_shadow(report)


class _HostCopies:
    """The rounds' device-to-host copies, started without waiting: into pinned memory (an asynchronous copy needs
    it), each with an event to wait on. Buffers and events are kept per shape and reused once their round has
    settled, so a round allocates nothing (at most two rounds are in flight)."""

    def __init__(self):
        self.free: dict[tuple, list[tuple[torch.Tensor, torch.cuda.Event]]] = {}

    def start(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """(host tensor, event) for `packed`; a CPU tensor is copied now (no event): a static step's output is
        overwritten by its next call, as a GPU copy taken at launch is not."""
        if packed.device.type != "cuda":
            return packed.clone(), None
        free = self.free.setdefault((tuple(packed.shape), packed.dtype), [])
        if free:
            host, copied = free.pop()
        else:
            host, copied = torch.empty_like(packed, device="cpu").pin_memory(), torch.cuda.Event()
        host.copy_(packed, non_blocking=True)
        copied.record()
        return host, copied

    def read(self, host: torch.Tensor, copied: torch.cuda.Event | None) -> list:
        """Wait for the copy (the round's one host sync), read it, and give the buffer back."""
        if copied is None:
            return host.tolist()
        copied.synchronize()
        out = host.tolist()
        self.free[(tuple(host.shape), host.dtype)].append((host, copied))
        return out


class SpeculativeEngine:
    """Generation for one target (+ optional drafter), one sequence (`generate`) or a batch (`generate_batch`).
    The target cache is allocated once and reused by later calls (reallocated only when a call needs more slots
    or another batch size); the drafter's ring buffer is allocated once per batch size (its size does not
    depend on the context)."""

    def __init__(self, target, drafter=None, *, costs=None):
        self.target = target
        self.drafter = drafter
        # tree="auto"'s round costs: a longspec.infer.policy.CostModel (tests inject one), else measured here
        # on first need (`measure_round_costs`), one table per decoding mode and batch size
        # (`round_costs.cost_mode`), kept for later calls.
        self.costs = costs
        self.cost_tables: dict[tuple, MeasuredCosts] = {}
        # mode -> the target step's epoch in which `measure_round_costs` last ran every candidate in that mode,
        # building (capturing) their steps; a later epoch dropped them, and the next measure builds them again.
        self.steps_built: dict[tuple, int] = {}
        # tree="auto" policies by (candidates, decoding mode): what they learned (acceptance per depth, round
        # times) carries over to the next call, since drafter, target and device stay the same. A new call
        # then starts from the last one's estimates instead of the prior (short outputs never leave it).
        self.policies: dict[tuple, AdaptivePolicy] = {}
        self.device = target.embed_tokens.weight.device
        # Packed projections + fused layer steps for every forward this engine runs (a frozen target only).
        target.pack_weights()
        self.target_step = TargetStep(target)
        self._host_copies = _HostCopies()
        self._every_row_masks: dict[int, torch.Tensor] = {}  # `_every_row`
        # A chain's / forest's constant tree parts per batch size (plain, lookup and drafter-chain rounds).
        self.forests = ForestParts(self.device)
        # The committed tokens by position, per row: what the drafter's ring catches up from and what prompt
        # lookup (pld, tree="auto"'s lookup chains) matches in. The engine's, not the drafter's: pld has none.
        self.history = TokenHistory(self.device)
        self.draft_step = None
        if drafter is not None:
            if hasattr(drafter, "pack_weights") and not drafter.pack_weights():  # stand-ins have no weights
                warnings.warn(
                    "the drafter's weights require grad (or are sharded), so the engine drafts with unpacked "
                    "projections (slower); Drafter.from_pretrained returns it frozen, or call "
                    "drafter.requires_grad_(False)",
                    stacklevel=2,
                )
            self.draft_step = DraftStep(
                drafter, vocab_size=target.vocab_size, device=self.device, history=self.history,
                forests=self.forests,
            )  # fmt: skip
        if (
            drafter is not None
            and hasattr(drafter, "shared_storage_ok")
            and not drafter.shared_storage_ok(target)
        ):
            raise ValueError(
                "the drafter's embedding / LM head are not the target's (load it with this target)"
            )

    @property
    def cache(self) -> StaticKVCache | None:
        """The target's static KV cache (None until the first call or `reserve`)."""
        return self.target_step.cache

    @property
    def drafter_cache(self):
        """The drafter's ring buffer (a DrafterCache; None without a drafter or before the first call)."""
        return None if self.draft_step is None else self.draft_step.cache

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def generate(self, prompt_ids, config: GenerationConfig, *, method: str = "longspec") -> GenerationResult:
        """prompt_ids: [T] / [1, T] tensor or list of ints -> GenerationResult (tokens + stats); `method` is
        one of the engine's (`longspec.infer.methods.ENGINE_METHODS`). The batch of one."""
        return self.generate_batch([prompt_ids], config, method=method)[0]

    @torch.no_grad()
    def generate_batch(
        self, prompts, config: GenerationConfig, *, method: str = "longspec"
    ) -> list[GenerationResult]:
        """prompts: a list of prompts of any lengths (each as `generate` takes it) -> one GenerationResult per
        prompt, decoded together: one target forward per round for the whole batch. At T = 0 each sequence's
        tokens are its own single-sequence greedy output. With tree="auto" the policy's round costs are measured at
        this batch size (a larger batch makes big trees cost more: it may pick smaller ones), and its acceptance
        model learns from every row. On static shapes / CUDA graphs a batch runs in its power-of-two bucket,
        padded with frozen one-token rows, so one set of steps serves e.g. batches of 5 to 8."""
        if not isinstance(config, GenerationConfig):  # else an AttributeError on its first field read
            raise TypeError(
                f"config must be a GenerationConfig (longspec.infer.GenerationConfig(max_new_tokens=...)), got "
                f"{config!r}; the method is a keyword: method='ar'"
            )
        spec = get_method(method, runner="engine")
        if spec.needs_drafter and self.drafter is None:
            raise ValueError(f"method {method!r} needs a drafter (pass one, or use drafter.init=random)")
        if config.cuda_graphs and self.target.sparse_layers:
            raise ValueError(
                "cuda_graphs=True cannot capture this target: its mixture-of-experts blocks choose their experts on "
                "the host (HF's routing), which a CUDA graph cannot replay; use cuda_graphs=false (static_shapes="
                "true keeps the rounds' static steps)"
            )
        if config.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the target on a CUDA device")
        if not isinstance(prompts, torch.Tensor):  # (text fails in `_prompt_ids`, as one prompt or each char)
            if not hasattr(prompts, "__iter__"):
                raise TypeError(
                    f"prompts must be a list of prompts (token id lists or tensors), got {prompts!r}"
                )
            prompts = list(prompts)  # a generator of prompts, a tuple
        if len(prompts) == 0:
            raise ValueError("no prompts")
        prompts = [_prompt_ids(p, i, self.device) for i, p in enumerate(prompts)]
        # One host read per call: an id outside the embedding would otherwise be a device-side index error deep in
        # the prefill (on CUDA an asynchronous assert that poisons the context).
        low, high = torch.stack(torch.aminmax(torch.cat(prompts))).tolist()
        vocab = self.target.embed_tokens.num_embeddings
        if low < 0 or high >= vocab:
            raise ValueError(
                f"prompt token ids must lie in [0, {vocab}) (the target's vocabulary), got {low}..{high}"
            )
        exact = exact_positions(self.target.config)
        if exact is not None and max(p.numel() for p in prompts) + config.max_new_tokens > exact:
            raise ValueError(
                f"this target's {self.target.rotary.rope_type} rope changes its frequencies with the sequence's "
                f"length past {exact} positions, which the engine's fixed frequencies do not follow: the longest "
                f"prompt ({max(p.numel() for p in prompts)} tokens) + max_new_tokens={config.max_new_tokens} "
                f"must stay within {exact}"
            )
        self._fix_longrope([p.numel() for p in prompts], config)
        try:
            return self._decode_batch(prompts, config, method, spec)
        finally:
            self._release_longrope()

    def _decode_batch(self, prompts: list[torch.Tensor], config: GenerationConfig, method: str, spec):
        """`generate_batch` on validated prompts (device tensors), with the call's longrope set fixed."""
        real = len(prompts)
        # Run in the batch's bucket (static shapes); padding rows hold one token (a cheap prefill).
        prompts = prompts + [prompts[-1][-1:]] * (_rows(real, config) - real)
        batch, lengths = len(prompts), [p.numel() for p in prompts]
        self._ensure_cache(cache_slots(lengths, config), batch)
        policy = None  # ar: plain steps
        # May measure round costs (at this batch size): before timing, on a scratch state.
        if spec.needs_drafter:
            policy = choose_policy(self, config, max(lengths), batch_size=batch)
        elif spec.drafts == "ngram":  # pld: every round a lookup chain of pld_num_draft
            policy = FixedPolicy(Lookup(config.pld_num_draft))
        # On the device: a round's random draws need no host-to-device copy (and no host sync).
        generator = torch.Generator(device=self.device).manual_seed(config.seed)
        stats = [GenerationStats(method=method, prompt_len=n) for n in lengths]

        shadows = None
        with timer(stats[0], "prefill_s", self.device):
            roots = self._prefill(prompts, config, generator)  # [B]
            if spec.drafts is not None:  # drafter and lookup both read the history
                self.history.prefill(prompts)
            if spec.needs_drafter:
                self.draft_step.prefill(prompts)
            # tree="auto" with lookups: each row's shadow lookup, its prompt indexed on the host (host work of the
            # call's start, counted with the prefill: it grows with the prompt and was timed by neither clock)
            if getattr(policy, "lookups", ()):
                length = max(lookup.length for lookup in policy.lookups)
                branches = max(lookup.branches for lookup in policy.lookups)
                shadows = [LookupShadow(p.tolist(), length, config.pld_max_ngram, branches) for p in prompts]
        emitted = [[token] for token in roots.tolist()]  # host sync: the first tokens
        for shadow, first in zip(shadows or (), emitted, strict=False):
            shadow.extend(first, shadow=False)  # the first token: context, not a round's root

        clock = PhaseClock(self.device)
        decode_start = now(self.device)
        slots = BatchSlots(
            [row < real and not _finished(e, config, new=e) for row, e in enumerate(emitted)], self.device
        )
        loop = _DecodeLoop(self, method, config, policy, slots, emitted, stats, generator, clock, shadows)
        with no_gc():  # a collection's stall would be charged to a round (and to the policy's costs)
            loop.run(roots)
        decode_s = now(self.device) - decode_start
        snapshot = policy.snapshot(loop.context_after[-1]) if isinstance(policy, AdaptivePolicy) else {}
        results = []
        for row in range(real):
            stats[row].policy = snapshot
            stats[row].prefill_s, stats[row].decode_s = stats[0].prefill_s, decode_s
            clock.add_to(stats[row])
            tokens = _truncate(emitted[row], config)
            stats[row].num_new_tokens = len(tokens)
            results.append(GenerationResult(tokens=tokens, stats=stats[row]))
        return results

    def _fix_longrope(self, lengths: list[int], config: GenerationConfig) -> None:
        """A longrope target (Phi-3) rotates with its long factors in every HF forward of a prompt longer than
        its original context, and with its short ones while a sequence stays within it: fix that set for the
        call's forwards (the prefill's chunks would otherwise each pick their own). A sequence that would cross
        the original context while generating, or a batch with prompts on both sides of it, has no single set
        (HF switches mid-sequence): refused. The set holds for the call (`_release_longrope` ends it)."""
        rotary = self.target.rotary
        if rotary.long_inv_freq is None:
            return
        # The drafter keeps the target's rope, so it has both sets too: fixed with the target's (else it would
        # apply HF's rule per forward, a host read that a captured draft step cannot make).
        original = rotary.original_positions
        long = longrope_long(lengths, config.max_new_tokens, original)
        if long is None:
            raise ValueError(
                f"this target's longrope rope switches to its long factors past {original} positions (its original "
                f"context): prompts of {min(lengths)}-{max(lengths)} tokens + max_new_tokens={config.max_new_tokens} "
                f"need one set for the whole call: every prompt longer than {original} tokens, or every prompt + "
                f"max_new_tokens within {original}"
            )
        for r in self._rotaries():
            r.set_long(long)

    def _release_longrope(self) -> None:
        """After a call: the rotaries go back to HF's rule per forward (`_fix_longrope` fixed one set for the
        call), so a forward outside the engine (training, a baseline on the same TargetModel) is not left on
        the call's set."""
        for r in self._rotaries():
            r.set_long(None)

    def _rotaries(self) -> list:
        """The target's RotaryEmbedding, and the drafter's (a stand-in drafter may have none)."""
        return [r for r in (self.target.rotary, getattr(self.drafter, "rotary", None)) if r is not None]

    def _launch(
        self,
        method: str,
        widths: tuple[int, ...] | Lookup,
        roots: torch.Tensor,
        config: GenerationConfig,
        generator: torch.Generator,
        *,
        static: bool,
        clock: PhaseClock,
        slots: BatchSlots | None = None,
        context_len: int = 0,
    ) -> tuple[_Round, torch.Tensor]:
        """Queue one round (draft, verify, accept, commit) from `roots` [B], one tree per sequence; widths () = one
        plain target step, a `Lookup` = a prompt-lookup chain (every round of pld: its FixedPolicy). On static
        shapes the whole round is ONE static step (one graph launch with cuda_graphs), built once per round shape
        (`_round_key`); eager otherwise, the same function. Nothing is read on the host: the commit advances the
        cache lengths on the device and the round's outputs start their way to the host (`_finish` waits for
        them). Returns the round and the next roots [B] on the device. Rows not active in `slots` (finished)
        commit nothing and keep their root: computed but frozen. longspec's plain and lookup rounds leave the
        drafter's ring behind: their tokens enter only the history, and `_catch_up` fills the ring before the
        next drafting round."""
        capture, spec = config.cuda_graphs, get_method(method, runner="engine")
        batch = roots.shape[0]
        active = [True] * batch if slots is None else list(slots.active)
        launched_at = time.perf_counter()
        drafted = spec.needs_drafter and is_drafter_tree(widths)
        if drafted:
            layout = TreeLayout(widths)
            depth, max_children = layout.depth, max(widths)
        elif isinstance(widths, Lookup):
            depth, max_children = widths.length, widths.branches
        else:  # "ar", or longspec's "no speculation"
            depth, max_children = 0, 0
        shaping = _shaping(config) if drafted else None
        # What the round commits besides the cache lengths: the token history takes the round's tokens wherever it
        # is read (a lookup matches in it; the drafter's ring catches up from it, so a drafting method's plain
        # rounds record their token too); a drafter tree's round enters its path into the ring at once.
        history = self.history if spec.needs_drafter or (spec.drafts is not None and widths) else None
        ring = self.draft_step if drafted else None
        # The random draws are made here, outside the step, so a replayed graph gets fresh ones. A batch's rows
        # that run (a device tensor per pattern) are an input of every round of the batch, so a row that
        # finishes changes no step (a step built mid-call is a capture inside the timed decode).
        extras: dict[str, torch.Tensor] = {}
        if shaping is not None:
            extras["noise"] = self.draft_step.noise(batch, layout, generator)
        if config.temperature > 0:
            extras["draws"] = uniforms((batch, depth * max_children + 1), generator, self.device)
        if batch > 1:
            extras["mask"] = slots.mask() if slots is not None else self._every_row(batch)
        names = tuple(extras)

        # Eager rounds time their phases; a static step is timed whole (with graphs: one launch), as verify_s.
        phase = clock.phase if not static else _untimed

        def run(roots, *values):
            given = dict(zip(names, values, strict=True))
            with phase("draft_s"):
                if drafted:
                    n = self.target_step.lengths(static)
                    noise = given.get("noise")
                    tree = self.draft_step.draft_tree(roots, layout, self.target_step, n, shaping, noise)
                elif isinstance(widths, Lookup):
                    tree = self._lookup(roots, widths, config.pld_max_ngram, static)
                else:
                    tree = self._plain_tree(roots)
            with phase("verify_s"):
                logits = self.target_step.tree_logits(tree, static=static)
                draws = given.get("draws")
                packed, bonus = accept_round(logits, tree, config, depth, max_children, draws)
            with phase("overhead_s"):
                mask = given.get("mask")
                counts = packed[:, -1] if mask is None else packed[:, -1] * mask
                paths = packed[:, depth + 1 : 2 * (depth + 1)]
                self._commit(tree.tokens, paths, counts, history, ring, in_place=tree.is_one_chain)
                if mask is not None:  # frozen rows keep their root (the step's own copy of it)
                    bonus = torch.where(mask, bonus, roots)
            return packed, bonus

        inputs = (roots, *extras.values())
        if static:
            key = self._round_key(widths, config, names, history, ring, capture)
            # A round's commit changes the caches for good: the step warms up once, on this round's inputs, and
            # that run is this round's (`TargetStep.static_step`).
            with clock.phase("verify_s"):
                packed, bonus = self.target_step.static_step(key, run, inputs, capture, effects=True)
        else:
            packed, bonus = run(*inputs)
        self.cache.device_advanced()
        host, copied = self._host_copies.start(packed)
        rnd = _Round(widths, depth, active, host, copied, launched_at, context_len)
        return rnd, bonus

    def _every_row(self, batch: int) -> torch.Tensor:
        """The mask of a batch whose rows all run (a round launched without slots: the round costs' timing), made
        once per batch size: a host-to-device copy per round would wait for the rounds in flight."""
        if batch not in self._every_row_masks:
            self._every_row_masks[batch] = torch.ones(batch, dtype=torch.bool, device=self.device)
        return self._every_row_masks[batch]

    def _round_key(self, widths, config, names, history, ring, capture: bool) -> tuple:
        """What a round's static step depends on besides the batch (`TargetStep.static_step` adds it): the round's
        shape, the acceptance rule's and the drafter's sampling settings, the lookup's n-gram length, what it
        commits (history, ring) and which extra inputs it takes."""
        shape = (
            ("lookup", widths.length, widths.branches, config.pld_max_ngram)
            if isinstance(widths, Lookup)
            else ("tree", tuple(widths))
        )
        sampling = (config.temperature, config.top_k, config.top_p) if config.temperature > 0 else ()
        commits = (history is not None, ring is not None)
        return (
            "round",
            shape,
            sampling,
            _shaping(config) if ring is not None else None,
            commits,
            names,
            capture,
        )

    def _plain_tree(self, roots: torch.Tensor) -> DraftTree:
        """A plain round's one-node tree per row around `roots` [B]: everything but the tokens is the same in every
        round, made once per batch size, so the round launches nothing to build it (a plain round's host work is
        what keeps it from costing one AR step)."""
        parents, depths, ancestor_mask, valid = self.forests(roots.shape[0], 0)
        return DraftTree(roots[:, None], parents, depths, ancestor_mask, valid, chain=True)

    def _lookup(self, roots: torch.Tensor, lookup: Lookup, max_ngram: int, static: bool) -> DraftTree:
        """A lookup round's forest [B, 1 + length x branches] from `roots` [B] (`pld.lookup_tree` over the
        history, at each row's committed length -- the device lengths on static shapes; one branch: a chain)."""
        parts = self.forests(roots.shape[0], lookup.length, lookup.branches)[:3]  # valid: the lookup's
        lengths = self.target_step.lengths(static)
        if not isinstance(lengths, torch.Tensor):
            lengths = torch.full_like(roots, lengths)
        return lookup_tree(self.history.tokens, lengths, roots, lookup, max_ngram, parts)

    def _finish(self, rnd: _Round) -> tuple[list[list[int]], list[list[int]]]:
        """Wait for a launched round's outputs (the round's ONE host sync: emitted tokens, paths and counts
        copied together) and commit its counts on the host. Returns, per sequence, the emitted tokens and the
        accepted path's node slots (a frozen row's are its frozen tree's: ignore them)."""
        out = self._host_copies.read(rnd.packed, rnd.copied)
        self.cache.commit([row[-1] if keep else 0 for row, keep in zip(out, rnd.active, strict=True)])
        depth = rnd.depth
        return [row[: row[-1]] for row in out], [row[depth + 1 : depth + 1 + row[-1]] for row in out]

    def _select_slots(self, index: list[int], roots: torch.Tensor) -> torch.Tensor:
        """Per-slot state follows `BatchSlots.shrink`: the target cache rows, the token history's and the
        drafter's ring rows (moved in place, so the steps of the smaller bucket, built once, serve again), the
        drafter's own per-row state (if it has a `select_rows`), and the roots."""
        moves = compaction(index)
        self.cache.move_rows(moves, len(index))
        self.history.move_rows(moves, len(index))
        if self.draft_step is not None and self.draft_step.cache is not None:
            self.draft_step.move_rows(moves, len(index))
        if hasattr(self.drafter, "select_rows"):  # a drafter with per-row state of its own
            self.drafter.select_rows(index)
        return roots.index_select(0, torch.tensor(index, device=self.device))

    def _commit(self, tokens, paths, counts, history, ring, *, in_place: bool = False) -> None:
        """The round's commit from device values only (paths [B, depth + 1], counts [B]: 0 for frozen rows), run
        inside the round's step: each row's accepted path moved in the target cache (`StaticKVCache.move_path`,
        the whole path width), unless it is `in_place` (a chain's: its accepted nodes are its first ones, already
        at the committed slots; a plain round's one node too); then one launch of bookkeeping
        (`kernels.path_commit`): the committed lengths advance, the path's tokens enter the token `history` (when
        given) and, with `ring` (a drafter tree's round), the ring's slots for them are claimed, whose K/V the
        drafter's RoPE step then writes (`DraftStep.write_path`). The host lengths follow when the round settles
        (`_finish`)."""
        cache = self.cache
        in_place |= paths.shape[1] == 1  # no drafts: the one node's K/V already sit at each row's length
        if not in_place:
            cache.move_path(paths, cache.lengths_t)
        # the path's tokens, root first (a chain's are its first nodes)
        path_tokens = tokens[:, : paths.shape[1]] if in_place else tokens.gather(1, paths.clamp(min=0))
        rings = (
            {}
            if ring is None
            else dict(ring_positions=ring.cache.positions, ring_appended=ring.cache.num_appended)
        )
        positions, slots = commit_path(
            path_tokens, counts, cache.lengths_t, history=None if history is None else history.tokens, **rings
        )
        if ring is not None:
            ring.write_path(path_tokens, positions, slots)

    def _catch_up(self, *, static: bool, capture: bool) -> None:
        """The drafter's ring catches up to the device's committed lengths (`DraftStep.catch_up`), as one static
        step on static shapes (one graph launch with cuda_graphs), with rounds still in flight."""
        draft, cache = self.draft_step, self.cache
        if not static:
            draft.catch_up(cache.lengths_t)
            return
        self.target_step.static_step(
            ("catch_up", capture), draft.catch_up, (cache.lengths_t,), capture, effects=True
        )

    # ------------------------------------------------------------------ a round's pieces
    # Public so benchmarks/round_latency.py can time them one by one; `generate` strings them together.
    def reserve(self, max_len: int, batch_size: int = 1) -> None:
        """Allocate the target cache for `max_len` tokens per sequence (prompt + new tokens + two rounds) up
        front, so later calls up to that size neither reallocate nor, with cuda_graphs, re-capture."""
        self._ensure_cache(max_len, batch_size)

    def reserve_for(self, prompt_lengths: list[int], config: GenerationConfig) -> None:
        """Allocate the target cache for a `generate_batch` of prompts up to these lengths (one per row) under
        `config`: exactly the slots and rows the call will ask for (`cache_slots`, the batch's bucket), so it
        does not reallocate. A reallocation inside a call drops every captured step with the old cache and
        re-captures them inside the timed decode: the eval once reserved one round short, and its longest
        samples decoded at a third of their speed."""
        lengths = list(prompt_lengths)
        lengths += [1] * (_rows(len(lengths), config) - len(lengths))
        self._ensure_cache(cache_slots(lengths, config), len(lengths))

    def prefill(self, prompt, config: GenerationConfig, generator=None) -> torch.Tensor:
        """Chunked prefill of the whole prompt into the (reserved) cache; returns the first generated token
        (0-d, on device). A list of prompts fills one cache row each and returns their first tokens [B]."""
        if isinstance(prompt, list):
            return self._prefill(prompt, config, generator)
        return self._prefill([prompt], config, generator)[0]

    def prefill_drafter(self, prompt) -> None:
        """The token history from the prompt, and the ring buffer from its last `window` tokens, or of each of a
        list of prompts (`TokenHistory.prefill`, `DraftStep.prefill`)."""
        prompts = prompt if isinstance(prompt, list) else [prompt]
        self.history.prefill(prompts)
        self.draft_step.prefill(prompts)

    def draft(
        self,
        root: torch.Tensor,
        layout: TreeLayout,
        *,
        static: bool = False,
        capture: bool = False,
        config: GenerationConfig | None = None,
        generator: torch.Generator | None = None,
    ) -> DraftTree:
        """The round's draft tree for `root` (0-d, at position cache.length; or roots [B], one tree per cache
        row: a tree of [B, N]), eager or static / captured (`DraftStep.draft`). With a config whose `rrs` is set,
        children are sampled from the drafter's q shaped like the target's distribution (noise from
        `generator`) and the tree carries q as `draft_probs`."""
        shaping = None if config is None else _shaping(config)
        tree = self.draft_step.draft(
            root.reshape(-1), layout, self.target_step, static=static, capture=capture, shaping=shaping,
            generator=generator,
        )  # fmt: skip
        return tree if root.dim() else tree.row(0)

    def verify(self, tree: DraftTree, *, static: bool = False, capture: bool = False) -> torch.Tensor:
        """ONE target forward over all tree nodes -> logits [N, V] (a tree of [B, N]: [B, N, V];
        `TargetStep.verify`); their K/V stay in the cache's pending slots until the round's commit.
        static / capture: see GenerationConfig."""
        if tree.tokens.dim() == 2:
            return self.target_step.verify(tree, static=static, capture=capture)
        batched = tree.per_sequence(lambda t: t[None])
        return self.target_step.verify(batched, static=static, capture=capture)[0]

    def measure_round_costs(
        self, config: GenerationConfig, context_lens, *, reps: int = 4, batch_size: int = 1
    ) -> MeasuredCosts:
        """tree="auto"'s round costs measured on this device at `batch_size` rows, per context bucket
        (`round_costs`); kept in `self.cost_tables` for later calls in the same mode."""
        return _measure_round_costs(self, config, context_lens, reps=reps, batch_size=batch_size)

    def policy_state(self) -> dict[tuple, AdaptivePolicy]:
        """A copy of what the tree policies have learned so far, to restart from later (`restore_policies`):
        the eval's timing repeats each start from the same state, so a repeat does not decode a text its
        policy has already learned. The measured cost tables (and an injected cost model) are shared, not
        copied: they describe the device, not a call."""
        return self._copy_policies(self.policies)

    def restore_policies(self, state: dict[tuple, AdaptivePolicy]) -> None:
        """The policies as `state` (from `policy_state`) holds them; `state` itself stays reusable."""
        self.policies = self._copy_policies(state)

    def _copy_policies(self, policies: dict[tuple, AdaptivePolicy]) -> dict[tuple, AdaptivePolicy]:
        shared = [*self.cost_tables.values(), self.costs]
        return copy.deepcopy(policies, memo={id(t): t for t in shared if t is not None})

    def warm_up(
        self,
        prompt,
        config: GenerationConfig,
        *,
        batch_size: int = 1,
        method: str = "longspec",
        tokens: int = 8,
    ) -> None:
        """Build, untimed, what a `generate_batch` of `batch_size` prompts up to `prompt`'s length runs under
        `config`: the cache for the whole batch first (reserved once, so nothing below reallocates it), then a
        short call (`tokens` new tokens) at the batch's bucket and at every smaller power-of-two bucket, the ones
        a static batch shrinks into as its rows finish (`slots.BatchSlots`). Each builds (with cuda_graphs:
        captures) its static steps; under tree="auto" it also measures that bucket's round costs, which runs
        every candidate tree (a bucket measured before the batch's cache dropped its steps, e.g. the batch of
        one's, runs every candidate once again, untimed: `round_costs.measure_round_costs`). Without it, a timed
        call's first shrink built (captured) that bucket's steps inside its timing: the eval's batch-4 cells
        whose rows finished early ran at 0.45-0.53x of batched graph AR, which was itself slower there than at
        batch 1 (docs/BENCHMARKS.md); and without the re-run, at 0.21x where the batch of one's steps had been
        dropped.

        The tree policies learn nothing from it (their state is put back afterwards): its short calls decode one
        prompt again and again, at buckets the timed calls may never reach, and what a drafter accepts there is
        not what it accepts on the real batch. A drafter that accepted nothing in them (the batch benchmark's
        stand-in proposes each row's own reference text, while every warm-up row decodes the one prompt) left
        tree="auto" with a drafter estimate near zero that no later round revised: every exploration then tried
        a lookup chain instead, and batch 16 at 8K decoded plain throughout (1.00x of batched graph AR, where
        batch 8 ran 1.45x, docs/BENCHMARKS.md). The measured round costs, which describe the device, are kept."""
        prompt = _prompt_ids(prompt, 0, self.device)
        self.reserve_for([prompt.numel()] * batch_size, config)
        rows = _rows(batch_size, config)
        buckets = [rows >> i for i in range(rows.bit_length())] if config.static else [batch_size]
        short = dataclasses.replace(config, max_new_tokens=min(tokens, config.max_new_tokens))
        learned = self.policy_state()
        try:
            for size in buckets:
                self.generate_batch([prompt] * size, short, method=method)
        finally:
            self.restore_policies(learned)

    def _ensure_cache(self, needed: int, batch_size: int = 1) -> None:
        """The target cache reserved for `needed` tokens per row (reused, or grown); the token history (a slot per
        cache slot) and the drafter's ring buffer allocated with it on first use, the ring in the cache's dtype,
        one row per sequence."""
        self.target_step.reserve(needed, batch_size)
        grown = self.history.allocate(batch_size, self.cache.max_len)
        draft = self.draft_step
        grown |= draft is not None and draft.allocate(self.cache.keys.dtype, batch_size)
        if grown:
            # the rounds' and catch-up's steps read the old ring's / history's addresses
            self.target_step.drop_steps()

    def _prefill(self, prompts: list[torch.Tensor], config: GenerationConfig, generator) -> torch.Tensor:
        """`TargetStep.prefill` of every prompt -> the first generated token of each [B] (on device)."""
        logits = self.target_step.prefill(prompts, config.prefill_chunk)  # [B, V]
        return self._pick(logits, config, generator)

    def _pick(self, logits: torch.Tensor, config: GenerationConfig, generator) -> torch.Tensor:
        if config.temperature == 0:
            return row_argmax(logits)
        target_probs = target_distribution(
            logits, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
        )
        return sample_token(target_probs, generator)


def accept_round(
    logits: torch.Tensor,
    tree: DraftTree,
    config: GenerationConfig,
    depth: int,
    max_children: int,
    draws: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The round's acceptance rule on the device, per sequence (the tree's fields [B, N], logits [B, N, V]; greedy
    at T = 0, else `sample_path` with the given uniform `draws` [B, ...], against the tree's `draft_probs` when
    its children were sampled): (packed [B, 2 (depth + 1) + 1] = emitted tokens, path (padded), count; bonus
    [B]); nothing read on the host, fixed shapes. A tree that is one chain (one branch) has no walk
    (`kernels.chain_accept`): greedy, the leading run of matches with its output in one launch; sampled,
    `sample_chain_path` (its decisions in one launch, the bonus in two) and the output in one."""
    tokens, valid, chain = tree.tokens, tree.valid, tree.is_one_chain
    if config.temperature == 0:
        target_argmax = row_argmax(logits)
        if chain:
            return greedy_chain_packed(tokens, target_argmax, valid)
        paths, lengths, bonus = greedy_path(
            tokens, tree.parents, tree.depths, tree.ancestor_mask, target_argmax, valid, depth
        )
    else:
        target_probs = target_distribution(
            logits, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
        )
        if chain:  # the decisions, the bonus draw and the output: four launches on CUDA
            _, lengths, bonus = sample_chain_path(tokens, valid, target_probs, draws, depth, tree.draft_probs)
            return chain_packed(tokens, lengths, bonus), bonus
        paths, lengths, bonus = sample_path(
            tokens, tree.parents, valid, target_probs, draws, depth=depth, max_children=max_children,
            draft_probs=tree.draft_probs,
        )  # fmt: skip
    emitted = emitted_tokens(tokens, paths, lengths, bonus)
    return torch.cat([emitted, paths, lengths[:, None]], dim=1), bonus


@contextlib.contextmanager
def _untimed(name: str):
    """`PhaseClock.phase`'s stand-in inside a static step (a captured graph must not record the clock's events)."""
    yield


def _prompt_ids(prompt, index: int, device: torch.device) -> torch.Tensor:
    """Prompt `index` of a call as a 1-D long tensor on `device`, or one error saying what is wrong with it. Once
    every prompt was cast and flattened: a [2, T] tensor given to `generate` decoded as ONE prompt of 2T tokens,
    a flat list of ids given to `generate_batch` as T prompts of one token each, float ids were truncated."""
    if isinstance(prompt, (str, bytes)):
        raise TypeError("prompts are token ids, not text: tokenize them first (tokenizer(text)['input_ids'])")
    try:
        ids = torch.as_tensor(prompt)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"prompt {index} is not a sequence of token ids: {error}") from None
    if ids.dim() == 0:
        raise TypeError(
            f"prompt {index} is one token id ({prompt!r}): a prompt is a list or tensor of token ids, and "
            "generate_batch takes a list of prompts (one prompt: generate)"
        )
    if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
        raise ValueError(
            f"prompt {index} has shape {list(ids.shape)}: a prompt is [T] or [1, T] token ids; several prompts "
            "go to generate_batch as a list (or a [B, T] tensor)"
        )
    if ids.numel() == 0:
        raise ValueError("empty prompt")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"prompt token ids must be integers, got dtype {ids.dtype} (prompt {index})")
    return ids.to(device=device, dtype=torch.long).flatten()


def _rows(batch: int, config: GenerationConfig) -> int:
    """Cache rows for a batch of `batch` prompts: on static shapes its power-of-two bucket (`slots.bucket`), so
    one set of steps serves e.g. batches of 5 to 8."""
    return bucket(batch) if config.static and batch > 1 else batch


def cache_slots(lengths: list[int], config: GenerationConfig) -> int:
    """Cache slots per row for a call: the longest prompt + max_new_tokens + three rounds of slack (the last
    round may commit past max_new_tokens; a row that ended in a round still in flight commits one more; a
    finished row's frozen tree is still verified, into pending slots, while the others run), or what the
    ragged prefill writes if more."""
    return max(
        max(lengths) + config.max_new_tokens + 3 * config.max_round_nodes,
        prefill_slots(lengths, config.prefill_chunk),
    )


def _shaping(config: GenerationConfig) -> tuple | None:
    """(temperature, top_k, top_p) when longspec's trees are sampled from the drafter's q (the "rrs" rule)."""
    return (config.temperature, config.top_k, config.top_p) if config.rrs else None


def _finished(emitted: list[int], config: GenerationConfig, *, new: list[int]) -> bool:
    """Stop once max_new_tokens are out or one of the `new` tokens is an EOS."""
    return len(emitted) >= config.max_new_tokens or any(t in config.eos_token_ids for t in new)


def _level_ranks(widths, path_slots: list[int]) -> list[int]:
    """Rank of each accepted node within its level (its slot minus the level's first slot): what the
    acceptance model learns from (a lookup's: its branch at depth 1, then 0 down the chain, as `Lookup.widths`
    models it). path_slots starts with the root."""
    if not widths:
        return []
    if isinstance(widths, Lookup):  # level 1's slots are 1..branches: the branch; one node a level below it
        accepted = len(path_slots) - 1
        return [path_slots[1] - 1] + [0] * (accepted - 1) if accepted else []
    layout = TreeLayout(widths)
    return [slot - layout.level_slice(d).start for d, slot in enumerate(path_slots[1:], start=1)]


def _truncate(emitted: list[int], config: GenerationConfig) -> list[int]:
    tokens = emitted[: config.max_new_tokens]
    for i, token in enumerate(tokens):
        if token in config.eos_token_ids:
            return tokens[: i + 1]
    return tokens
