"""The drafter side of a round (docs/ALGORITHM.md §4.1): the drafter's ring buffer (prefill, catch-up, commit) and
the dynamic-beam draft tree, eager or on static buffers (captured in a CUDA graph when asked).

Shape legend: N tree nodes, P nodes of one tree level, n committed tokens (the root's position), W drafter window,
V vocabulary, Dm model width, Hkv key-value heads, Tmax target cache slots, D head dim.
"""

from __future__ import annotations

import torch

from longspec.drafter import DrafterCache, DraftNodes
from longspec.infer.accept import target_distribution
from longspec.infer.target_step import TargetStep
from longspec.infer.tree import DraftTree, TreeLayout, beam_step, sample_step

__all__ = ["DraftStep"]


class DraftStep:
    """Owns the drafter's ring buffer: O(window) whatever the context, so allocated once per engine (captured
    graphs keep its address). A draft reads the target's committed cache through a `TargetStep`, whose
    `static_step` holds the static / captured draft steps next to its verify steps."""

    def __init__(self, drafter, *, vocab_size: int, device: torch.device):
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.device = device
        self.cache: DrafterCache | None = None  # the ring buffer, allocated by `allocate`

    def allocate(self, dtype: torch.dtype) -> None:
        """Allocate the ring buffer (in the target cache's dtype) on first use; later calls keep it."""
        if self.cache is None:
            self.cache = DrafterCache(self.drafter.config, 1, dtype=dtype, device=self.device)

    def prefill(self, prompt: torch.Tensor) -> None:
        """Fill the ring buffer with the self-attention K/V of the last `window` prompt tokens only: the
        drafter never runs cross-attention over the prompt (the first round's root does that, once)."""
        self.cache.reset()
        positions = torch.arange(prompt.numel(), device=self.device)
        self.drafter.fill_cache(self.cache, prompt[None], positions)

    def catch_up(self, emitted: list[int], prompt_len: int, start: int, end: int) -> None:
        """Committed positions [start, end) enter the ring buffer (after plain rounds skipped it); emitted[i]
        sits at position prompt_len + i. Only the last `window` can survive in the ring."""
        start = max(start, end - self.cache.window)
        ids = torch.tensor(
            emitted[start - prompt_len : end - prompt_len], dtype=torch.long, device=self.device
        )
        positions = torch.arange(start, end, device=self.device)
        self.drafter.fill_cache(self.cache, ids[None], positions)

    def commit(self, path_tokens: torch.Tensor, first_position: int) -> None:
        """The accepted path (root first) enters the drafter's ring buffer. Its self K/V depend only on token and
        position, so recomputing them for k+1 tokens is cheaper than keeping them for every tree node."""
        positions = torch.arange(first_position, first_position + path_tokens.numel(), device=self.device)
        self.drafter.fill_cache(self.cache, path_tokens[None], positions)

    def draft(
        self,
        root: torch.Tensor,
        layout: TreeLayout,
        target: TargetStep,
        *,
        static: bool = False,
        capture: bool = False,
        shaping: tuple | None = None,
        generator: torch.Generator | None = None,
    ) -> DraftTree:
        """The round's draft tree for `root` (at position target.cache.length): eager, or on static buffers
        (captured in a CUDA graph when asked; the returned tensors are then the graph's, valid until the next
        call). With `shaping` = (temperature, top_k, top_p), children are sampled from the drafter's q (noise
        from `generator`, drawn outside the step so a graph replays fresh noise) and the tree carries q as
        `draft_probs`."""
        inputs = (root.reshape(1),)
        if shaping is not None:
            rows = layout.num_nodes - layout.widths[-1]  # nodes that get children
            noise = torch.empty(rows, self.vocab_size, device=self.device)
            inputs += (noise.exponential_(generator=generator),)
        if not static:
            return self._tree(root, layout, target, target.cache.length, shaping, *inputs[1:])

        def fn(root_buf, *noise_buf):
            return self._tree(
                root_buf[0], layout, target, target.cache.length_t, shaping, *noise_buf
            ).dynamic_part()

        outputs = target.static_step(("draft", layout.widths, capture, shaping), fn, inputs, capture)
        return DraftTree.from_dynamic_part(layout, *outputs)

    def _tree(
        self,
        root: torch.Tensor,
        layout: TreeLayout,
        target: TargetStep,
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
        drafter, dcache = self.drafter, self.cache
        tree = DraftTree.empty(layout, root)
        if shaping is not None:
            tree.draft_probs = torch.zeros(layout.num_nodes, self.vocab_size, device=self.device)
        # Self-attention K/V of every tree node, filled level by level; a node sits at position n + its depth.
        nodes = DraftNodes(dcache, n + tree.depths)  # works for an int or a 0-d tensor n
        target_k, target_v = target.cache.keys[-1], target.cache.values[-1]  # last layer [1, Hkv, Tmax, D]
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
