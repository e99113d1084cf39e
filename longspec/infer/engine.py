"""Speculative generation on a static target KV cache: LongSpec tree drafting, hybrid verification, lossless
acceptance; the same engine also runs plain autoregressive decoding ("ar") and prompt-lookup drafting ("pld").

Shape legend: B sequences decoded together, T new tokens in one target forward, n committed tokens (cache length,
per sequence), V vocabulary.

`SpeculativeEngine` owns one target's (and drafter's) state and strings a call together: validate the prompts,
reserve the cache, choose the call's policy (`policy.measure.choose_policy`), prefill (`RoundRunner.start`), then
the rounds (`loop.DecodeLoop` on `runner.RoundRunner`: one round per loop step, docs/ALGORITHM.md §4).

A batch (`generate_batch`) runs the same round with one tree per sequence: every sequence has its own position,
cache length and ring-buffer row; the trees share one round shape and are verified in ONE target forward [B, N];
each sequence commits its own accepted path. A finished sequence stays in the batch, frozen, so the shapes stay
those of the batch; on static shapes a batch runs in its power-of-two bucket and moves to the smaller one once
half of it has finished (`slots.BatchSlots`, GenerationConfig.shrink_min_tokens). `generate` is the batch of one.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass, field

import torch

from longspec.infer.cache import StaticKVCache
from longspec.infer.candidates import Lookup
from longspec.infer.config import GenerationConfig
from longspec.infer.draft_step import DraftStep
from longspec.infer.graphs import no_gc
from longspec.infer.history import TokenHistory
from longspec.infer.loop import DecodeLoop, finished
from longspec.infer.methods import get_method
from longspec.infer.policy import AdaptivePolicy, FixedPolicy, LookupShadow, MeasuredCosts
from longspec.infer.policy.measure import choose_policy, measure_round_costs
from longspec.infer.runner import RoundRunner
from longspec.infer.slots import BatchSlots, bucket
from longspec.infer.stats import GenerationStats
from longspec.infer.target_step import TargetStep, prefill_slots
from longspec.infer.timing import PhaseClock, now, timer
from longspec.infer.tree import ForestParts
from longspec.modules.rope import exact_positions, longrope_long

__all__ = ["GenerationConfig", "GenerationResult", "SpeculativeEngine", "cache_slots"]


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens (prompt excluded), truncated at EOS / max_new_tokens
    stats: GenerationStats = field(default_factory=GenerationStats)


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
        # (`policy.measure.cost_mode`), kept for later calls.
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
        self.runner = RoundRunner(self.target_step, self.draft_step, self.history, self.forests, self.device)
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
            # drafter and lookup both read the history
            history, ring = spec.drafts is not None, spec.needs_drafter
            roots = self.runner.start(prompts, config, generator, history=history, ring=ring)  # [B]
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
            [row < real and not finished(e, config, new=e) for row, e in enumerate(emitted)], self.device
        )
        loop = DecodeLoop(
            self.runner, spec, config, policy, slots, emitted, stats, generator, clock, shadows, self.drafter
        )
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

    def measure_round_costs(
        self, config: GenerationConfig, context_lens, *, reps: int = 4, batch_size: int = 1
    ) -> MeasuredCosts:
        """tree="auto"'s round costs measured on this device at `batch_size` rows, per context bucket
        (`policy.measure`); kept in `self.cost_tables` for later calls in the same mode."""
        return measure_round_costs(self, config, context_lens, reps=reps, batch_size=batch_size)

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
        one's, runs every candidate once again, untimed: `policy.measure.measure_round_costs`). Without it, a timed
        call's first shrink would build (capture) that bucket's steps inside its timing.

        The tree policies learn nothing from it (their state is put back afterwards): its short calls decode one
        prompt again and again, at buckets the timed calls may never reach, and what a drafter accepts there is
        not what it accepts on the real batch. The measured round costs, which describe the device, are kept."""
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


def _truncate(emitted: list[int], config: GenerationConfig) -> list[int]:
    tokens = emitted[: config.max_new_tokens]
    for i, token in enumerate(tokens):
        if token in config.eos_token_ids:
            return tokens[: i + 1]
    return tokens
