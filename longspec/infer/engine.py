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
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from longspec.drafter import DrafterCache, DraftNodes
from longspec.infer.accept import (
    emitted_tokens,
    greedy_path,
    sample_path,
    sample_token,
    target_distribution,
    uniforms,
)
from longspec.infer.cache import StaticKVCache
from longspec.infer.graphs import StaticStep
from longspec.infer.methods import get_method
from longspec.infer.pld import prompt_lookup
from longspec.infer.policy import (
    AUTO_TREES,
    DEFAULT_TREE_WIDTHS,
    AdaptivePolicy,
    FixedPolicy,
    MeasuredCosts,
    context_bucket,
)
from longspec.infer.stats import GenerationStats
from longspec.infer.tree import DraftTree, TreeLayout, beam_step, chain_tree, sample_step, tree_name
from longspec.modules import attention as attn_ops
from longspec.modules.attention import within_window

__all__ = ["GenerationConfig", "GenerationResult", "SpeculativeEngine", "DEFAULT_TREE_WIDTHS"]

SAMPLING_RULES = ("rrs", "deterministic")


@dataclass(kw_only=True)
class GenerationConfig:
    """How to decode. Sampling settings shape the TARGET distribution only; output stays lossless."""

    max_new_tokens: int = 256  # tokens to generate, the prefill's first token included
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # keep the k most likely target tokens (T > 0)
    top_p: float | None = None  # nucleus truncation of the target distribution (T > 0)
    eos_token_ids: tuple[int, ...] = ()  # stop after emitting any of these
    # longspec's tree: "auto" (adaptive per round, longspec.infer.policy) or fixed level widths; a fixed
    # `tree_widths` given by the user wins over `tree`. At T > 0 every tree samples the target's distribution
    # exactly, but with "auto" the trees chosen depend on measured round times (and on what earlier calls
    # learned), so a seed does not pin the sample: fix the tree for reproducible sampling.
    tree: str | tuple[int, ...] = "auto"
    tree_widths: tuple[int, ...] | None = None
    # T > 0: "rrs" = children sampled from the drafter's q, recursive rejection sampling; "deterministic" = the
    # drafter's top candidates, accepted by p alone (both lossless; longspec.infer.accept.sample_path).
    sampling_rule: str = "rrs"
    pld_num_draft: int = 10  # PLD: tokens proposed per round
    pld_max_ngram: int = 3  # PLD: longest n-gram matched against the context
    prefill_chunk: int = 4096  # target prefill tokens per forward
    seed: int = 0  # sampling RNG seed (T > 0)
    static_shapes: bool = False  # rounds read the cache length from the device (what a CUDA graph replays)
    cuda_graphs: bool = (
        False  # capture each round's draft and target forward in CUDA graphs (implies static_shapes)
    )

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.prefill_chunk < 1 or self.pld_num_draft < 1 or self.pld_max_ngram < 1:
            raise ValueError("prefill_chunk, pld_num_draft and pld_max_ngram must be >= 1")
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        if self.tree_widths is not None:
            self.tree_widths = tuple(int(w) for w in self.tree_widths)
            TreeLayout(self.tree_widths)  # validates the widths
        if isinstance(self.tree, str):
            if self.tree != "auto":
                raise ValueError(f"tree must be 'auto' or a list of level widths, got {self.tree!r}")
        else:
            self.tree = tuple(int(w) for w in self.tree)
            TreeLayout(self.tree)
        if self.sampling_rule not in SAMPLING_RULES:
            raise ValueError(f"sampling_rule must be one of {SAMPLING_RULES}, got {self.sampling_rule!r}")

    @property
    def fixed_tree(self) -> tuple[int, ...] | None:
        """The user's fixed widths (tree_widths, else a tuple `tree`), or None for tree="auto"."""
        if self.tree_widths is not None:
            return self.tree_widths
        return None if self.tree == "auto" else self.tree

    @property
    def trees(self) -> tuple[tuple[int, ...], ...]:
        """Every tree a longspec round may run."""
        fixed = self.fixed_tree
        return (fixed,) if fixed is not None else AUTO_TREES

    @property
    def max_round_nodes(self) -> int:
        """The most tokens one round of any method verifies (sizes the cache's slack)."""
        return max(1 + max(sum(t) for t in self.trees), 1 + self.pld_num_draft)

    @property
    def rrs(self) -> bool:
        """Whether longspec's trees are sampled from the drafter's q (T > 0 with the "rrs" rule)."""
        return self.temperature > 0 and self.sampling_rule == "rrs"


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
        self._policies: dict[tuple, AdaptivePolicy] = {}
        self.device = target.embed_tokens.weight.device
        self.scales = [layer.self_attn.scaling for layer in target.layers]
        self.cache: StaticKVCache | None = None
        self.drafter_cache = None
        self._steps: dict[tuple, StaticStep] = {}  # static / captured steps by (kind, shape, capture)
        if (
            drafter is not None
            and hasattr(drafter, "shared_storage_ok")
            and not drafter.shared_storage_ok(target)
        ):
            raise ValueError(
                "the drafter's embedding / LM head are not the target's (load it with this target)"
            )

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
            policy = self._policy(config, prompt.numel())
        # On the device: a round's random draws need no host-to-device copy (and no host sync).
        generator = torch.Generator(device=self.device).manual_seed(config.seed)
        stats = GenerationStats(method=method, prompt_len=prompt.numel())

        with _timer(stats, "prefill_s", self.device):
            root = self.prefill(prompt, config, generator)
            if spec.needs_drafter:
                self.prefill_drafter(prompt)
        emitted = [int(root)]  # host sync: the first token
        context = torch.cat([prompt, root.reshape(1)]) if spec.drafts == "ngram" else None

        clock = _PhaseClock(self.device)
        decode_start = _now(self.device)
        finished = _finished(emitted, config, new=emitted)
        # Committed tokens whose K/V are in the drafter's ring buffer: positions < drafter_synced. A plain round
        # ("no speculation") leaves the ring alone, so it costs what one AR step costs; the ring catches up
        # (its last `window` tokens at most) when speculation resumes.
        drafter_synced = self.cache.length
        while not finished:
            context_len = self.cache.length
            widths = policy.choose(context_len) if policy is not None else ()
            if spec.needs_drafter and widths and drafter_synced < context_len:
                self._drafter_catch_up(emitted, prompt.numel(), drafter_synced, context_len)
            round_start = time.perf_counter()
            new_tokens, path_slots, root = self._round(
                method, widths, root, config, generator, static=static, clock=clock, context=context,
                commit_drafter=bool(widths),
            )  # fmt: skip
            if policy is not None:
                policy.observe_time(widths, context_len, time.perf_counter() - round_start)
                layout_ranks = _level_ranks(widths, path_slots)
                policy.observe(widths, layout_ranks)
                if widths:
                    drafter_synced = self.cache.length
            stats.record_round(len(new_tokens) - 1, tree_name(widths) if spec.needs_drafter else None)
            emitted.extend(new_tokens)
            if context is not None:
                context = torch.cat([context, torch.tensor(new_tokens, device=self.device)])
            finished = _finished(emitted, config, new=new_tokens)
        stats.decode_s = _now(self.device) - decode_start
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
        clock: _PhaseClock,
        context: torch.Tensor | None = None,
        commit_drafter: bool = True,
    ) -> tuple[list[int], list[int], torch.Tensor]:
        """One round (draft, verify, accept, commit) from `root`; widths () = one plain target step.
        Returns (emitted tokens, accepted path's node slots, next root on the device) after ONE host copy.
        commit_drafter=False: longspec's accepted tokens do not enter the drafter's ring buffer (a plain round;
        `_drafter_catch_up` adds them later)."""
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
        with clock.phase("verify_s"):
            logits = self.verify(tree, static=static, capture=capture)  # [N, V]
        with clock.phase("overhead_s"):
            path, length, bonus = self._accept(tree, logits, config, generator, depth, max_children)
            out = torch.cat([emitted_tokens(tree.tokens, path, length, bonus), path, length.reshape(1)])
            out = out.tolist()  # host sync: the round's one copy (emitted tokens, path, count)
            count = out[-1]
            self.cache.commit_path(path[:count])
            if spec.needs_drafter and commit_drafter:
                self._drafter_commit(tree.tokens[path[:count]], self.cache.length - count)
        return out[:count], out[depth + 1 : depth + 1 + count], bonus

    def reserve(self, max_len: int) -> None:
        """Allocate the target cache for `max_len` tokens (prompt + new tokens + one round) up front, so later
        calls up to that size neither reallocate nor, with cuda_graphs, re-capture."""
        self._ensure_cache(max_len)

    # ------------------------------------------------------------------ target side
    def _target_forward(
        self,
        tokens: torch.Tensor,
        offsets: torch.Tensor,
        new_mask: torch.Tensor | None,
        *,
        static: bool = False,
    ) -> torch.Tensor:
        """Target forward over T new tokens at positions n + offsets [T], n = the committed length. new_mask
        [T, T] says which new tokens see which (a tree's ancestor mask); None means a causal chunk (prefill).
        Every new token sees the whole committed prefix (within a sliding window where the layer has one). K/V
        land in the cache's pending slots; the caller commits. Returns hidden [T, Dm].

        The cache length comes from the host (`cache.length`, eager) or, with static=True, from the device
        (`cache.length_t`): no host value is read, new K/V go to slots n + i by index_copy_, and a
        sliding-window layer gathers a fixed-size key window, so the forward can be captured in a CUDA graph."""
        cache, T = self.cache, tokens.shape[0]
        n = cache.length_t if static else cache.length
        # Eager's fast case: the first prefill chunk is a square causal block, where the flash kernels apply.
        first_chunk = not static and new_mask is None and n == 0
        if new_mask is None:
            new_mask = offsets[None, :] <= offsets[:, None]  # causal
        if static:
            slots = n + torch.arange(T, device=tokens.device)

            def write(layer_idx, k, v):
                return cache.update_static(layer_idx, k, v, slots)

        else:
            write = cache.update
        windowed: dict[int, tuple[slice | torch.Tensor, torch.Tensor]] = {}

        def attn_fn(layer_idx, q, k, v):
            keys, values = write(layer_idx, k, v)  # [B, Hkv, Tmax, D]
            window, scale = self.target.layer_windows[layer_idx], self.scales[layer_idx]
            if first_chunk and window is None:
                out, _ = attn_ops.attention(q, k, v, causal=True, scale=scale)
                return out
            if window is None:  # cache part unmasked + new part under new_mask, merged by LSE
                out, _ = attn_ops.hybrid_attention(q, k, v, keys, values, n, new_mask, scale=scale)
                return out
            # Sliding-window layer: only keys within `window` of the queries matter; one explicit mask.
            if window not in windowed:
                windowed[window] = _window_keys(n, offsets, new_mask, window)
            select, mask = windowed[window]
            out, _ = attn_ops.tree_attention(q, _take(keys, select), _take(values, select), mask, scale=scale)
            return out

        return self.target(tokens[None], (n + offsets)[None], attn_fn=attn_fn).hidden[0]

    def prefill(self, prompt: torch.Tensor, config: GenerationConfig, generator=None) -> torch.Tensor:
        """Chunked prefill of the whole prompt into the (reserved) cache; returns the first generated token
        (0-d, on device). The pieces of a round (`prefill`, `prefill_drafter`, `draft`, `verify`) are public so
        benchmarks/round_latency.py can time them one by one; `generate` strings them together."""
        hidden = None
        for start in range(0, prompt.numel(), config.prefill_chunk):
            chunk = prompt[start : start + config.prefill_chunk]
            hidden = self._target_forward(chunk, torch.arange(chunk.numel(), device=self.device), None)
            self.cache.commit(chunk.numel())
        logits = self.target.logits(hidden[-1:])  # [1, V]
        return self._pick(logits[0], config, generator)

    def verify(self, tree: DraftTree, *, static: bool = False, capture: bool = False) -> torch.Tensor:
        """ONE target forward over all tree nodes -> logits [N, V] (node i predicts its children). Their K/V
        stay in the cache's pending slots until `cache.commit_path`. static / capture: see GenerationConfig."""
        if not static:
            return self.target.logits(self._target_forward(tree.tokens, tree.depths, tree.ancestor_mask))
        inputs = (tree.tokens, tree.depths, tree.ancestor_mask)
        return self._static_step(("verify", tree.num_nodes, capture), self._static_logits, inputs, capture)

    def _static_step(self, key, fn, inputs: tuple[torch.Tensor, ...], capture: bool):
        """Run fn on static buffers (built, and captured when asked, on first use) with the cache length
        mirrored on the device. Warm-up / capture calls only write pending cache slots: harmless."""
        self.cache.sync_length()
        if key not in self._steps:
            self._steps[key] = StaticStep(fn, inputs, capture=capture)
        return self._steps[key](*inputs)

    def _static_logits(
        self, tokens: torch.Tensor, offsets: torch.Tensor, new_mask: torch.Tensor
    ) -> torch.Tensor:
        """The verify forward with no host values (what `_static_step` runs and captures) -> logits [T, V]."""
        return self.target.logits(self._target_forward(tokens, offsets, new_mask, static=True))

    def _ensure_cache(self, needed: int) -> None:
        """Allocate the target cache once and reuse it across calls; grow (and drop captured graphs, which hold
        its addresses) only when a call needs more slots."""
        if getattr(self, "cache", None) is not None and self.cache.max_len >= needed:
            self.cache.reset()
            return
        self.cache = None  # free the old one first
        self._steps = {}
        self.cache = StaticKVCache.for_target(self.target, max_len=needed)
        if self.drafter is not None and self.drafter_cache is None:
            # O(window) whatever the context: allocated once per engine (graphs keep its address).
            self.drafter_cache = DrafterCache(
                self.drafter.config, 1, dtype=self.cache.keys.dtype, device=self.device
            )

    def _pick(self, logits: torch.Tensor, config: GenerationConfig, generator) -> torch.Tensor:
        if config.temperature == 0:
            return torch.argmax(logits, dim=-1)
        target_probs = target_distribution(
            logits, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
        )
        return sample_token(target_probs, generator)

    def _accept(
        self,
        tree: DraftTree,
        logits: torch.Tensor,
        config: GenerationConfig,
        generator,
        depth: int,
        max_children: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(path [depth + 1] padded, length [], bonus []) on the device; nothing read on the host."""
        if config.temperature == 0:
            return greedy_path(
                tree.tokens,
                tree.parents,
                tree.depths,
                tree.ancestor_mask,
                torch.argmax(logits, dim=-1),
                tree.valid,
                depth,
            )
        target_probs = target_distribution(
            logits, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
        )
        draws = uniforms((1, depth * max_children + 1), generator, self.device)
        draft_probs = None if tree.draft_probs is None else tree.draft_probs[None]
        path, length, bonus = sample_path(
            tree.tokens[None],
            tree.parents[None],
            tree.valid[None],
            target_probs[None],
            draws,
            depth=depth,
            max_children=max_children,
            draft_probs=draft_probs,
        )
        return path[0], length[0], bonus[0]

    # ------------------------------------------------------------------ tree="auto"
    def _policy(self, config: GenerationConfig, prompt_len: int):
        fixed = config.fixed_tree
        if fixed is not None:
            return FixedPolicy(fixed)
        if self.costs is None or isinstance(self.costs, MeasuredCosts):
            self.measure_round_costs(config, [prompt_len, prompt_len + config.max_new_tokens])
        key = (tuple(config.trees), config.temperature > 0, config.sampling_rule, config.cuda_graphs, id(self.costs))
        if key not in self._policies:
            # Measured costs are refined by the rounds' observed times; an injected cost model is taken as given.
            measured = isinstance(self.costs, MeasuredCosts)
            self._policies[key] = AdaptivePolicy(self.costs, config.trees, learn_times=measured)
        policy = self._policies[key]
        policy.start()
        return policy

    @torch.no_grad()
    def measure_round_costs(self, config: GenerationConfig, context_lens, *, reps: int = 8) -> MeasuredCosts:
        """Measure, on this device, the seconds of one real round (`_round`: draft + verify + accept + commit, on
        the static / captured path when the config asks for it) of every tree="auto" candidate, per context
        bucket between min(context_lens) and max(context_lens). The cache's content is whatever it holds (a
        round's cost does not depend on it); its length is set to the bucket (within the reserved size). Only
        missing buckets are measured; the cache and ring buffer are reset after. First use of a shape captures
        its graphs here, outside any timed decode. Returns (and keeps) the table."""
        if self.drafter is None:
            raise ValueError("measuring longspec round costs needs a drafter")
        static = config.static_shapes or config.cuda_graphs
        mode = (config.temperature > 0, config.sampling_rule, static, config.cuda_graphs)
        if not isinstance(self.costs, MeasuredCosts) or self.costs.mode != mode:
            self.costs = MeasuredCosts(mode=mode)
        low, high = context_bucket(min(context_lens)), context_bucket(max(context_lens))
        buckets = [1 << e for e in range(low.bit_length() - 1, high.bit_length())]
        missing = self.costs.missing(config.trees, buckets)
        if not missing:
            return self.costs
        self._ensure_cache(max(context_lens) + config.max_round_nodes + 1)
        generator = torch.Generator(device=self.device).manual_seed(0)
        root = torch.zeros((), dtype=torch.long, device=self.device)
        clock = _PhaseClock(self.device)
        self.drafter_cache.reset()
        for bucket in missing:
            length = max(1, min(bucket, self.cache.max_len - config.max_round_nodes - 1))
            times: dict[tuple[int, ...], list[float]] = {w: [] for w in config.trees}
            # Candidates interleaved rep by rep (a slow moment hits them all), each round timed on its own (it
            # ends with its host copy), the median kept; the first rep is untimed: lazy init, autotuning,
            # graph capture.
            for rep in range(reps + 1):
                for widths in config.trees:
                    self.cache.length = length
                    start = time.perf_counter()
                    self._round(
                        "longspec", widths, root, config, generator, static=static, clock=clock,
                        commit_drafter=bool(widths),
                    )  # fmt: skip
                    if rep:
                        times[widths].append(time.perf_counter() - start)
            for widths, seconds in times.items():
                self.costs.seconds[(bucket, widths)] = statistics.median(seconds)
        self.cache.reset()
        self.drafter_cache.reset()
        return self.costs

    # ------------------------------------------------------------------ drafter side
    def prefill_drafter(self, prompt: torch.Tensor) -> None:
        """Fill the ring buffer with the self-attention K/V of the last `window` prompt tokens only: the
        drafter never runs cross-attention over the prompt (the first round's root does that, once)."""
        self.drafter_cache.reset()
        positions = torch.arange(prompt.numel(), device=self.device)
        self.drafter.fill_cache(self.drafter_cache, prompt[None], positions)

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
        """The round's draft tree for `root` (at position cache.length): eager, or on static buffers (captured
        in a CUDA graph when asked; the returned tensors are then the graph's, valid until the next call).
        With a config whose `rrs` is set, children are sampled from the drafter's q (noise from `generator`,
        drawn outside the step so a graph replays fresh noise) and the tree carries q as `draft_probs`."""
        shaping = None
        inputs = (root.reshape(1),)
        if config is not None and config.rrs:
            shaping = (config.temperature, config.top_k, config.top_p)
            rows = layout.num_nodes - layout.widths[-1]  # nodes that get children
            noise = torch.empty(rows, self.target.vocab_size, device=self.device)
            inputs += (noise.exponential_(generator=generator),)
        if not static:
            return self._draft_tree(root, layout, self.cache.length, shaping, *inputs[1:])

        def fn(root_buf, *noise_buf):
            return self._draft_tree(
                root_buf[0], layout, self.cache.length_t, shaping, *noise_buf
            ).dynamic_part()

        outputs = self._static_step(("draft", layout.widths, capture, shaping), fn, inputs, capture)
        return DraftTree.from_dynamic_part(layout, *outputs)

    def _draft_tree(
        self,
        root: torch.Tensor,
        layout: TreeLayout,
        n: int | torch.Tensor,
        shaping: tuple | None = None,
        noise: torch.Tensor | None = None,
    ) -> DraftTree:
        """Dynamic beam search over `layout` (ALGORITHM §4.1): one drafter step per level, all of a level's nodes
        at once; a node self-attends to the ring buffer (within its window) and to its tree ancestors, and
        cross-attends to the committed target prefix [0, n) (the root sits at position n). `n` may be a device
        tensor (static shapes: no host value is read). With `shaping` = (temperature, top_k, top_p) and Exp(1)
        `noise` [nodes with children, V], each level is `sample_step` from q = the drafter's distribution
        shaped like the target's, instead of the beam."""
        drafter, dcache = self.drafter, self.drafter_cache
        tree = DraftTree.empty(layout, root)
        if shaping is not None:
            tree.draft_probs = torch.zeros(layout.num_nodes, self.target.vocab_size, device=self.device)
        # Self-attention K/V of every tree node, filled level by level; a node sits at position n + its depth.
        nodes = DraftNodes(dcache, n + tree.depths)  # works for an int or a 0-d tensor n
        target_k, target_v = self.cache.keys[-1], self.cache.values[-1]  # last layer [1, Hkv, Tmax, D]
        scores = torch.zeros(1, device=self.device)  # cumulative draft log-prob of each current-level path
        for level in range(layout.depth):
            sl = layout.level_slice(level)
            ancestors = tree.ancestor_mask[sl, : sl.stop]  # [P, nodes so far], self included
            hidden = drafter.tree_level(
                tree.tokens[sl][None], dcache, nodes, sl, ancestors, target_k, target_v, n
            )  # [1, P, Dm]
            logits = drafter.logits(hidden[0]).float()  # [P, V]
            child_slice = layout.level_slice(level + 1)
            if shaping is None:
                logprobs = torch.log_softmax(logits, dim=-1)
                parent_local, tokens, scores = beam_step(scores, logprobs, layout.widths[level])
            else:
                temperature, top_k, top_p = shaping
                q = target_distribution(logits, temperature=temperature, top_k=top_k, top_p=top_p)
                tree.draft_probs[sl] = q
                parent_local, tokens, scores, valid = sample_step(scores, q, noise[sl], layout.widths[level])
                tree.valid[child_slice] = valid
            tree.set_level(child_slice, parent_local + sl.start, tokens)
        return tree

    def _drafter_catch_up(self, emitted: list[int], prompt_len: int, start: int, end: int) -> None:
        """Committed positions [start, end) enter the ring buffer (after plain rounds skipped it); emitted[i]
        sits at position prompt_len + i. Only the last `window` can survive in the ring."""
        start = max(start, end - self.drafter_cache.window)
        ids = torch.tensor(emitted[start - prompt_len : end - prompt_len], dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, device=self.device)
        self.drafter.fill_cache(self.drafter_cache, ids[None], positions)

    def _drafter_commit(self, path_tokens: torch.Tensor, first_position: int) -> None:
        """The accepted path (root first) enters the drafter's ring buffer. Its self K/V depend only on token and
        position, so recomputing them for k+1 tokens is cheaper than keeping them for every tree node."""
        positions = torch.arange(first_position, first_position + path_tokens.numel(), device=self.device)
        self.drafter.fill_cache(self.drafter_cache, path_tokens[None], positions)


def _finished(emitted: list[int], config: GenerationConfig, *, new: list[int]) -> bool:
    """Stop once max_new_tokens are out or one of the `new` tokens is an EOS."""
    return len(emitted) >= config.max_new_tokens or any(t in config.eos_token_ids for t in new)


def _window_keys(
    n: int | torch.Tensor, offsets: torch.Tensor, new_mask: torch.Tensor, window: int
) -> tuple[slice | torch.Tensor, torch.Tensor]:
    """(select, mask [T, K + T]) for a sliding-window layer's attention over the cache ++ T new tokens at
    positions n + offsets: `select` picks the K cached keys that may be in a query's window and the new ones;
    cached key j is visible iff it exists and within_window(n + offset, j); new tokens follow new_mask within
    the window. Host n: the slice [max(0, n - window), n + T). Device n (static shapes, no host sync): slot
    indices, the `window` slots before n (clamped at 0, masked when they do not exist) then the T new ones."""
    T, device = offsets.shape[0], offsets.device
    if isinstance(n, torch.Tensor):
        cached = n - window + torch.arange(window, device=device)  # may be < 0: no such key
        select = torch.cat([cached.clamp(min=0), n + torch.arange(T, device=device)])
    else:
        lo = max(0, n - window)
        cached = torch.arange(lo, n, device=device)
        select = slice(lo, n + T)
    cache_part = (cached >= 0)[None, :] & within_window((n + offsets)[:, None], cached[None, :], window)
    new_part = new_mask & within_window(offsets[:, None], offsets[None, :], window)
    return select, torch.cat([cache_part, new_part], dim=1)


def _take(keys: torch.Tensor, select: slice | torch.Tensor) -> torch.Tensor:
    """keys [B, Hkv, Tmax, D] at the slots `select` (a slice, or an index tensor gathered on the device)."""
    return keys[:, :, select] if isinstance(select, slice) else keys.index_select(2, select)


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


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: phase timing needs the GPU to have finished
    return time.perf_counter()


class _PhaseClock:
    """Time of the round's phases without host syncs: on CUDA, events recorded on the stream and read once at
    the end (`add_to`); on the CPU, wall time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self.events: list[tuple[str, object, object]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.cuda:
            start = time.perf_counter()
            yield
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.events.append((name, start, end))

    def add_to(self, stats: GenerationStats) -> None:
        for name, start, end in self.events:
            end.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + start.elapsed_time(end) / 1000
        self.events.clear()
        for name, seconds in self.seconds.items():
            setattr(stats, name, getattr(stats, name) + seconds)
        self.seconds.clear()


@contextmanager
def _timer(stats: GenerationStats, name: str, device: torch.device) -> Iterator[None]:
    start = _now(device)
    yield
    setattr(stats, name, getattr(stats, name) + _now(device) - start)
