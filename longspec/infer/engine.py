"""Speculative generation on a static target KV cache: LongSpec tree drafting, hybrid verification, lossless
acceptance; the same engine also runs plain autoregressive decoding ("ar") and prompt-lookup drafting ("pld").

Shape legend: B batch (= 1), T new tokens in one target forward, N tree nodes, n committed tokens (cache length),
W drafter window, V vocabulary, Dm model width, H / Hkv query / key-value heads, D head dim.

One round (docs/ALGORITHM.md §4), starting from the root = the last token emitted, at position n, not yet in any cache:
  1. draft:  a dynamic-beam tree of N nodes (root + sum(widths)); every node cross-attends to the target's
             last-layer K/V < n and self-attends to the drafter's ring buffer (committed tokens in its window)
             plus its tree ancestors;
  2. verify: ONE target forward over the N nodes at positions n + depth; per layer the new K/V go to the cache's
             pending slots and attention = merge(cache part unmasked, tree part under the ancestor mask);
  3. accept: greedy or lossless sampling (longspec.infer.accept), on the device with fixed shapes -> accepted
             path (padded) + its length + bonus token; then the round's ONE host sync: the emitted tokens, the
             path and its length copied out together;
  4. commit: the path's K/V move into place for every layer (no re-feeding); the drafter's ring buffer takes
             the path's self-attention K/V; the bonus becomes the next root.
Every round of one tree shape has the same shapes (N fixed, padded), which is what CUDA-graph capture needs; with
tree="auto" (longspec.infer.policy) the shape may change between rounds: one static / captured step per shape.

This module strings the round together (`generate` -> `_round`) and accepts; the pieces live by side:
`draft_step.DraftStep` (the drafter's ring buffer and the draft tree), `target_step.TargetStep` (the target's
cache, prefill and verify forward, the static steps), `round_costs` (tree="auto": the policy and the measured
round costs), `timing` (phase clocks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from longspec.infer.accept import (
    emitted_tokens,
    greedy_path,
    sample_path,
    sample_token,
    target_distribution,
    uniforms,
)
from longspec.infer.cache import StaticKVCache
from longspec.infer.config import DEFAULT_TREE_WIDTHS, GenerationConfig
from longspec.infer.draft_step import DraftStep
from longspec.infer.methods import get_method
from longspec.infer.pld import prompt_lookup
from longspec.infer.policy import AdaptivePolicy, MeasuredCosts
from longspec.infer.round_costs import choose_policy
from longspec.infer.round_costs import measure_round_costs as _measure_round_costs
from longspec.infer.stats import GenerationStats
from longspec.infer.target_step import TargetStep
from longspec.infer.timing import PhaseClock, now, timer
from longspec.infer.tree import DraftTree, TreeLayout, chain_tree, tree_name

# GenerationConfig and DEFAULT_TREE_WIDTHS live in longspec.infer.config; the engine is their public home.
__all__ = ["GenerationConfig", "GenerationResult", "SpeculativeEngine", "DEFAULT_TREE_WIDTHS"]


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens (prompt excluded), truncated at EOS / max_new_tokens
    stats: GenerationStats = field(default_factory=GenerationStats)


class SpeculativeEngine:
    """Batch-1 generation for one target (+ optional drafter). The target cache is allocated once and reused by
    later calls (grown only when a call needs more than prompt + max_new_tokens + one round of slack); the
    drafter's ring buffer is allocated once (its size does not depend on the context)."""

    def __init__(self, target, drafter=None, *, costs=None):
        self.target = target
        self.drafter = drafter
        # tree="auto"'s round costs: a longspec.infer.policy.CostModel (tests inject one), else measured here
        # on first need (`measure_round_costs`) and kept for later calls.
        self.costs = costs
        # tree="auto" policies by (candidates, decoding mode): what they learned (acceptance per depth, round
        # times) carries over to the next call, since drafter, target and device stay the same. A new call
        # then starts from the last one's estimates instead of the prior (short outputs never leave it).
        self.policies: dict[tuple, AdaptivePolicy] = {}
        self.device = target.embed_tokens.weight.device
        self.target_step = TargetStep(target)
        self.draft_step = None
        if drafter is not None:
            self.draft_step = DraftStep(drafter, vocab_size=target.vocab_size, device=self.device)
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
        one of the engine's (`longspec.infer.methods.ENGINE_METHODS`)."""
        spec = get_method(method, runner="engine")
        if spec.needs_drafter and self.drafter is None:
            raise ValueError(f"method {method!r} needs a drafter (pass one, or use drafter.init=random)")
        static = config.static_shapes or config.cuda_graphs
        if config.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the target on a CUDA device")
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=self.device).flatten()
        if prompt.numel() == 0:
            raise ValueError("empty prompt")
        self._ensure_cache(prompt.numel() + config.max_new_tokens + config.max_round_nodes + 1)
        policy = None
        if spec.needs_drafter:  # may measure round costs: before any timing, on a scratch cache state
            policy = choose_policy(self, config, prompt.numel())
        # On the device: a round's random draws need no host-to-device copy (and no host sync).
        generator = torch.Generator(device=self.device).manual_seed(config.seed)
        stats = GenerationStats(method=method, prompt_len=prompt.numel())

        with timer(stats, "prefill_s", self.device):
            root = self.prefill(prompt, config, generator)
            if spec.needs_drafter:
                self.prefill_drafter(prompt)
        emitted = [int(root)]  # host sync: the first token
        context = torch.cat([prompt, root.reshape(1)]) if spec.drafts == "ngram" else None

        clock = PhaseClock(self.device)
        decode_start = now(self.device)
        finished = _finished(emitted, config, new=emitted)
        # Committed tokens whose K/V are in the drafter's ring buffer: positions < drafter_synced. A plain round
        # ("no speculation") leaves the ring alone, so it costs what one AR step costs; the ring catches up
        # (its last `window` tokens at most) when speculation resumes.
        drafter_synced = self.cache.length
        while not finished:
            context_len = self.cache.length
            widths = policy.choose(context_len) if policy is not None else ()
            if spec.needs_drafter and widths and drafter_synced < context_len:
                self.draft_step.catch_up(emitted, prompt.numel(), drafter_synced, context_len)
            round_start = time.perf_counter()
            new_tokens, path_slots, root = self._round(
                method, widths, root, config, generator, static=static, clock=clock, context=context,
                commit_drafter=bool(widths),
            )  # fmt: skip
            if policy is not None:
                policy.observe_time(widths, context_len, time.perf_counter() - round_start)
                layout_ranks = _level_ranks(widths, path_slots)
                policy.observe(widths, layout_ranks, context_len)
                if widths:
                    drafter_synced = self.cache.length
            stats.record_round(len(new_tokens) - 1, tree_name(widths) if spec.needs_drafter else None)
            emitted.extend(new_tokens)
            if context is not None:
                context = torch.cat([context, torch.tensor(new_tokens, device=self.device)])
            finished = _finished(emitted, config, new=new_tokens)
        stats.decode_s = now(self.device) - decode_start
        clock.add_to(stats)
        tokens = _truncate(emitted, config)
        stats.num_new_tokens = len(tokens)
        return GenerationResult(tokens=tokens, stats=stats)

    def _round(
        self,
        method: str,
        widths: tuple[int, ...],
        root: torch.Tensor,
        config: GenerationConfig,
        generator: torch.Generator,
        *,
        static: bool,
        clock: PhaseClock,
        context: torch.Tensor | None = None,
        commit_drafter: bool = True,
    ) -> tuple[list[int], list[int], torch.Tensor]:
        """One round (draft, verify, accept, commit) from `root`; widths () = one plain target step.
        Returns (emitted tokens, accepted path's node slots, next root on the device) after ONE host copy.
        commit_drafter=False: longspec's accepted tokens do not enter the drafter's ring buffer (a plain round;
        `DraftStep.catch_up` adds them later)."""
        capture, spec = config.cuda_graphs, get_method(method, runner="engine")
        if spec.needs_drafter and widths:
            layout = TreeLayout(widths)
            with clock.phase("draft_s"):
                tree = self.draft(
                    root, layout, static=static, capture=capture, config=config, generator=generator
                )
            depth, max_children = layout.depth, max(widths)
        elif spec.drafts == "ngram":
            with clock.phase("draft_s"):
                draft = prompt_lookup(context, config.pld_num_draft, config.pld_max_ngram)
                tree = chain_tree(root, draft, draft.numel(), 1 + config.pld_num_draft)
            depth, max_children = config.pld_num_draft, 1
        else:  # "ar", or longspec's "no speculation"
            tree = chain_tree(root, root.new_empty(0), 0, 1)
            depth, max_children = 0, 0
        # verify_s holds the acceptance rule too: it runs in the verify's step (one graph with cuda_graphs)
        with clock.phase("verify_s"):
            packed, bonus = self._verify_accept(tree, config, generator, depth, max_children, static, capture)
        with clock.phase("overhead_s"):
            path = packed[depth + 1 : 2 * (depth + 1)]
            out = packed.tolist()  # host sync: the round's one copy (emitted tokens, path, count)
            count = out[-1]
            self.cache.commit_path(path[:count])
            if spec.needs_drafter and commit_drafter:
                self.draft_step.commit(tree.tokens[path[:count]], self.cache.length - count)
        return out[:count], out[depth + 1 : depth + 1 + count], bonus

    def _verify_accept(
        self,
        tree: DraftTree,
        config: GenerationConfig,
        generator,
        depth: int,
        max_children: int,
        static: bool,
        capture: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify forward and the acceptance rule as ONE step (`TargetStep.verify` with a head): returns
        (packed [2 (depth + 1) + 1] = emitted tokens, path, count; bonus []) on the device. The random draws
        are made here, outside the step, so a replayed graph gets fresh ones."""
        sampling = config.temperature > 0
        head_inputs = (tree.parents, tree.valid)
        if sampling:
            head_inputs += (uniforms((1, depth * max_children + 1), generator, self.device),)
            if tree.draft_probs is not None:
                head_inputs += (tree.draft_probs,)
        key = ("accept", depth, max_children, sampling and tree.draft_probs is not None)
        if sampling:
            key += (config.temperature, config.top_k, config.top_p)

        def head(logits, tokens, depths, ancestor_mask, parents, valid, draws=None, draft_probs=None):
            path, length, bonus = accept_path(
                logits, tokens, parents, depths, ancestor_mask, valid, config, depth, max_children, draws,
                draft_probs,
            )  # fmt: skip
            return torch.cat([emitted_tokens(tokens, path, length, bonus), path, length.reshape(1)]), bonus

        return self.target_step.verify(
            tree, static=static, capture=capture, head=head, head_inputs=head_inputs, head_key=key
        )

    # ------------------------------------------------------------------ a round's pieces
    # Public so benchmarks/round_latency.py can time them one by one; `generate` strings them together.
    def reserve(self, max_len: int) -> None:
        """Allocate the target cache for `max_len` tokens (prompt + new tokens + one round) up front, so later
        calls up to that size neither reallocate nor, with cuda_graphs, re-capture."""
        self._ensure_cache(max_len)

    def prefill(self, prompt: torch.Tensor, config: GenerationConfig, generator=None) -> torch.Tensor:
        """Chunked prefill of the whole prompt into the (reserved) cache; returns the first generated token
        (0-d, on device)."""
        logits = self.target_step.prefill(prompt, config.prefill_chunk)  # [1, V]
        return self._pick(logits[0], config, generator)

    def prefill_drafter(self, prompt: torch.Tensor) -> None:
        """The ring buffer from the last `window` prompt tokens (`DraftStep.prefill`)."""
        self.draft_step.prefill(prompt)

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
        """The round's draft tree for `root` (at position cache.length), eager or static / captured
        (`DraftStep.draft`). With a config whose `rrs` is set, children are sampled from the drafter's q shaped
        like the target's distribution (noise from `generator`) and the tree carries q as `draft_probs`."""
        shaping = None
        if config is not None and config.rrs:
            shaping = (config.temperature, config.top_k, config.top_p)
        return self.draft_step.draft(
            root,
            layout,
            self.target_step,
            static=static,
            capture=capture,
            shaping=shaping,
            generator=generator,
        )

    def verify(self, tree: DraftTree, *, static: bool = False, capture: bool = False) -> torch.Tensor:
        """ONE target forward over all tree nodes -> logits [N, V] (`TargetStep.verify`); their K/V stay in the
        cache's pending slots until `cache.commit_path`. static / capture: see GenerationConfig."""
        return self.target_step.verify(tree, static=static, capture=capture)

    def measure_round_costs(self, config: GenerationConfig, context_lens, *, reps: int = 8) -> MeasuredCosts:
        """tree="auto"'s round costs measured on this device, per context bucket (`round_costs`); kept in
        `self.costs` for later calls."""
        return _measure_round_costs(self, config, context_lens, reps=reps)

    def _ensure_cache(self, needed: int) -> None:
        """The target cache reserved for `needed` tokens (reused, or grown); the drafter's ring buffer
        allocated with it on first use, in the cache's dtype."""
        self.target_step.reserve(needed)
        if self.draft_step is not None:
            self.draft_step.allocate(self.cache.keys.dtype)

    def _pick(self, logits: torch.Tensor, config: GenerationConfig, generator) -> torch.Tensor:
        if config.temperature == 0:
            return torch.argmax(logits, dim=-1)
        target_probs = target_distribution(
            logits, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
        )
        return sample_token(target_probs, generator)


def accept_path(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    ancestor_mask: torch.Tensor,
    valid: torch.Tensor,
    config: GenerationConfig,
    depth: int,
    max_children: int,
    draws: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The round's acceptance rule on the device (greedy at T = 0, else `sample_path` with the given uniform
    `draws`): (path [depth + 1] padded, length [], bonus []); nothing read on the host, fixed shapes."""
    if config.temperature == 0:
        target_argmax = torch.argmax(logits, dim=-1)
        return greedy_path(tokens, parents, depths, ancestor_mask, target_argmax, valid, depth)
    target_probs = target_distribution(
        logits, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
    )
    path, length, bonus = sample_path(
        tokens[None],
        parents[None],
        valid[None],
        target_probs[None],
        draws,
        depth=depth,
        max_children=max_children,
        draft_probs=None if draft_probs is None else draft_probs[None],
    )
    return path[0], length[0], bonus[0]


def _finished(emitted: list[int], config: GenerationConfig, *, new: list[int]) -> bool:
    """Stop once max_new_tokens are out or one of the `new` tokens is an EOS."""
    return len(emitted) >= config.max_new_tokens or any(t in config.eos_token_ids for t in new)


def _level_ranks(widths: tuple[int, ...], path_slots: list[int]) -> list[int]:
    """Rank of each accepted node within its level (its slot minus the level's first slot): what the
    acceptance model learns from. path_slots starts with the root."""
    if not widths:
        return []
    layout = TreeLayout(widths)
    return [slot - layout.level_slice(d).start for d, slot in enumerate(path_slots[1:], start=1)]


def _truncate(emitted: list[int], config: GenerationConfig) -> list[int]:
    tokens = emitted[: config.max_new_tokens]
    for i, token in enumerate(tokens):
        if token in config.eos_token_ids:
            return tokens[: i + 1]
    return tokens
