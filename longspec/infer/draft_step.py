"""The drafter side of a round (docs/ALGORITHM.md §4.1): the drafter's ring buffer (prefill, catch-up, commit) and
the dynamic-beam draft tree, eager or on static buffers (captured in a CUDA graph when asked).

Shape legend: B sequences (one tree each), N tree nodes, P nodes of one tree level, n committed tokens (the root's
position: an int shared by every row, or [B]), W drafter window, V vocabulary, Dm model width, Hkv key-value heads,
Tmax target cache slots, D head dim.
"""

from __future__ import annotations

import torch

from longspec.drafter import DrafterCache
from longspec.infer.accept import target_distribution
from longspec.infer.candidates import DEFAULT_TREE_WIDTHS
from longspec.infer.history import TokenHistory
from longspec.infer.target_step import TargetStep
from longspec.infer.tree import DraftTree, ForestParts, TreeLayout, beam_step, sample_step
from longspec.modules.constants import arange_once

__all__ = ["DraftStep", "RING_NODE_SLOTS"]

# The spare slots the ring's storage holds after its own for a draft's nodes (`DrafterCache.with_nodes`): the
# default tree's, the largest of tree="auto"'s candidates, so every default or auto draft views [ring ++ nodes]
# in place. A larger fixed tree (the user's tree_widths) copies the ring into its own storage each draft, as
# every draft once did: growing the ring on demand would reallocate it (its contents and every captured step
# that reads it) at a call's first larger tree, for ~2 copies of W slots saved per draft.
RING_NODE_SLOTS = 1 + sum(DEFAULT_TREE_WIDTHS)


class DraftStep:
    """Owns the drafter's ring buffer: O(window) whatever the context, so allocated once per engine (captured
    graphs keep its address). The committed tokens by position it catches up from are the engine's
    `TokenHistory` (shared with prompt lookup, which has no drafter), passed in.

    A drafting round's commit enters its accepted path into the ring (`write_path`); a plain round ("no
    speculation", tree="auto") only records its token in the history, inside its round's step, so it launches what
    an AR step does, and a lookup round records its path there in its commit; before the next drafting round
    `catch_up` computes the ring's missing tokens from the history. Both read only device values (per-row
    lengths, the ring's own positions), so they run inside the rounds' static / captured steps with nothing
    settled first, at any batch size. A draft reads the target's committed cache through a `TargetStep`, whose
    `static_step` holds the rounds' static / captured steps (a round drafts inside its own: `draft_tree`)."""

    def __init__(
        self,
        drafter,
        *,
        vocab_size: int,
        device: torch.device,
        history: TokenHistory,
        forests: ForestParts | None = None,
    ):
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.device = device
        self.cache: DrafterCache | None = None  # the ring buffer, allocated by `allocate`
        self.history = history  # the committed tokens by position (the engine's)
        # A chain's constant tree parts (the engine's, shared with its plain and lookup rounds)
        self.forests = ForestParts(device) if forests is None else forests

    def allocate(self, dtype: torch.dtype, batch_size: int = 1) -> bool:
        """Allocate the ring buffer (in the target cache's dtype, one row per sequence) on first use; later calls
        of up to as many rows keep it (working on its first rows), so captured steps stay valid. Returns whether
        it was (re)allocated: the steps that read the old one must go."""
        cache = self.cache
        if cache is not None and cache.capacity >= batch_size and cache.keys.dtype == dtype:
            self.cache.use_rows(batch_size)
            return False
        self.cache = None  # freed before the new one
        self.cache = DrafterCache(
            self.drafter.config, batch_size, dtype=dtype, device=self.device, spare=RING_NODE_SLOTS
        )
        return True

    def move_rows(self, moves: list[tuple[int, int]], rows: int) -> None:
        """Row `to` takes row `src`'s ring for each (to, src) (`DrafterCache.move_rows`)."""
        self.cache.move_rows(moves, rows)

    def prefill(self, prompts: list[torch.Tensor]) -> None:
        """Fill each row of the ring buffer with the self-attention K/V of the last `window` tokens of its
        prompt only: the drafter never runs cross-attention over the prompt (the first round's root does that,
        once). Shorter tails are left-padded (position -1: skipped). (The prompts enter the history with the
        engine's prefill.)"""
        self.cache.reset()
        width = min(self.cache.window, max(p.numel() for p in prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        positions = torch.full_like(ids, -1)
        for row, prompt in enumerate(prompts):
            tail = min(width, prompt.numel())
            ids[row, width - tail :] = prompt[prompt.numel() - tail :]
            positions[row, width - tail :] = torch.arange(prompt.numel() - tail, prompt.numel())
        self.drafter.fill_cache(self.cache, ids, positions)

    def catch_up(self, lengths: torch.Tensor) -> None:
        """The ring buffer catches up to the committed lengths [B]: each row's tokens at positions
        [lengths - window, lengths) that the ring lacks (those after the newest position it holds: a ring is
        filled in position order) are read from the history and their self-attention K/V computed, as if every
        round had committed them. Fixed shapes, device values only (a static / captured step); a row whose ring
        is complete writes nothing. Any number of missing tokens: one plain round's, a lookup chain's path and
        bonus, many rounds' (only the window's last ones are computed)."""
        window = self.cache.window
        positions = lengths[:, None] - window + arange_once(window, lengths.device)  # [B, W]
        held = positions <= self.cache.positions.amax(1, keepdim=True)  # up to the newest held (-1: none)
        ids = self.history.tokens.gather(1, positions.clamp(min=0))
        self.drafter.fill_cache(self.cache, ids, positions.masked_fill(held, -1))  # -1: padding

    def write_path(self, path_tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Each row's accepted path (root first) enters the ring buffer: path_tokens [B, k] at positions [B, k], their
        K/V written into the ring `slots` [B, k] (-1: a column past the row's count, not written) that the round's
        commit bookkeeping claimed (`kernels.path_commit`). Device values only (it runs inside the round's
        captured step). Self K/V depend only on token and position, so recomputing them for the k path tokens is
        cheaper than keeping them for every tree node."""
        ring = self.cache
        self.drafter.self_kv(path_tokens, positions, cache=(ring.keys, ring.values, slots))

    def draft(
        self,
        roots: torch.Tensor,
        layout: TreeLayout,
        target: TargetStep,
        *,
        static: bool = False,
        capture: bool = False,
        shaping: tuple | None = None,
        generator: torch.Generator | None = None,
    ) -> DraftTree:
        """The round's draft trees [B, N] for `roots` [B] (each at its row's position target.cache.lengths[b]):
        eager, or on static buffers (captured in a CUDA graph when asked; the returned tensors are then the
        graph's, valid until the next call). With `shaping` = (temperature, top_k, top_p), children are sampled
        from the drafter's q (noise from `generator`, drawn outside the step so a graph replays fresh noise) and
        the tree carries q as `draft_probs`."""
        inputs = (roots,)
        if shaping is not None:
            inputs += (self.noise(roots.shape[0], layout, generator),)
        if not static:
            return self.draft_tree(roots, layout, target, target.lengths(static=False), shaping, *inputs[1:])

        def fn(root_buf, *noise_buf):
            n = target.cache.lengths_t  # [B] on the device (synced by static_step)
            return self.draft_tree(root_buf, layout, target, n, shaping, *noise_buf).dynamic_part()

        outputs = target.static_step(("draft", layout.widths, capture, shaping), fn, inputs, capture)
        return DraftTree.from_dynamic_part(layout, *outputs)

    def noise(self, batch: int, layout: TreeLayout, generator: torch.Generator | None) -> torch.Tensor:
        """Exp(1) noise [B, nodes with children, Kd] for a sampled tree's levels (`sample_step`), drawn outside
        any static step so a replayed graph gets fresh noise."""
        noise = torch.empty(batch, layout.num_parents, self.drafter.draft_vocab_size, device=self.device)
        return noise.exponential_(generator=generator)

    def draft_tree(
        self,
        roots: torch.Tensor,
        layout: TreeLayout,
        target: TargetStep,
        n: int | torch.Tensor,
        shaping: tuple | None = None,
        noise: torch.Tensor | None = None,
    ) -> DraftTree:
        """Dynamic beam search over `layout` (ALGORITHM §4.1), one tree per row: one drafter step per level, all
        of a level's nodes of every row at once; a node self-attends to its row's ring buffer (within its window)
        and to its tree ancestors, and cross-attends to its row's committed target prefix [0, n) (the root sits
        at position n). `n` may be a device tensor (ragged rows / static shapes: no host value is read). With
        `shaping` = (temperature, top_k, top_p) and Exp(1) `noise` [B, nodes with children, Kd], each level is
        `sample_step` from q = the drafter's distribution shaped like the target's, instead of the beam."""
        drafter, dcache = self.drafter, self.cache
        batch, chain = roots.shape[0], layout.is_chain
        if chain:  # parents, depths and ancestors are constants; the tokens are gathered level by level
            tree = DraftTree(roots[:, None], *self.forests(batch, layout.depth), chain=True)
            level_tokens = [roots[:, None]]
        else:
            tree = DraftTree.empty(layout, roots)  # [B, N]
        if shaping is not None and not chain:  # q of every node with children (written level by level)
            tree.draft_probs = torch.empty(batch, layout.num_parents, self.vocab_size, device=self.device)
        level_q = []  # a chain's: one [B, 1, V] per level, joined at the end
        # Self-attention K/V of every tree node, filled level by level; a node sits at position n + its depth.
        # A chain's ancestor mask is a constant: the whole self-attention mask is written up front.
        nodes = drafter.draft_nodes(
            dcache, tree.depths, root=n, ancestors=tree.ancestor_mask if chain else None
        )
        target_k, target_v = target.cache.keys[-1], target.cache.values[-1]  # last layer [B, Hkv, Tmax, D]
        scores = None  # cumulative draft log-prob of each level's paths (None: the root's, 0)
        for level in range(layout.depth):
            sl = layout.level_slice(level)
            # [B, P, nodes so far], self included (a chain's went in up front)
            ancestors = None if chain else tree.ancestor_mask[:, sl, : sl.stop]
            inputs = level_tokens[level] if chain else tree.tokens[:, sl]
            hidden = drafter.tree_level(inputs, nodes, sl, ancestors, target_k, target_v, n)  # [B, P, Dm]
            # Tokens come back as target ids (a draft vocabulary's map applied on the device, in the pick's own
            # launch in a chain).
            if shaping is None and chain:  # the head's argmax, its logits never written where it can
                tokens = drafter.pick(hidden)  # [B, 1]
            elif shaping is None:
                logits = drafter.logits(hidden)  # [B, P, Kd]: by draft id (Kd = V without a draft vocabulary)
                parent_local, tokens, scores = beam_step(
                    scores,
                    logits,
                    layout.widths[level],
                    scores=layout.needs_scores(level),
                    ids=drafter.draft_ids,
                )
                valid = None
            else:
                logits = drafter.logits(hidden)
                temperature, top_k, top_p = shaping
                q = target_distribution(logits, temperature=temperature, top_k=top_k, top_p=top_p)
                # Acceptance reads q by target id; 0 outside a draft vocabulary (those ids are never drafted).
                if chain:
                    level_q.append(drafter.target_probs(q))
                else:
                    tree.draft_probs[:, sl] = drafter.target_probs(q)
                parent_local, tokens, scores, valid = sample_step(
                    scores, q, noise[:, sl], layout.widths[level], scores=layout.needs_scores(level),
                    ids=drafter.draft_ids,
                )  # fmt: skip
            if chain:  # only its tokens grow (a sampled chain's one draw per level is always valid)
                level_tokens.append(tokens)
            else:
                child_slice = layout.level_slice(level + 1)
                if valid is not None:  # (None: all valid)
                    tree.valid[:, child_slice] = valid
                tree.set_level(child_slice, parent_local + sl.start, tokens)
        if chain:
            tree.tokens = torch.cat(level_tokens, dim=1)
            if level_q:
                tree.draft_probs = level_q[0] if len(level_q) == 1 else torch.cat(level_q, dim=1)
        return tree
