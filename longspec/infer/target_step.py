"""The target side of a round: the static KV cache, the chunked prefill and the ONE verify forward over a draft
tree (docs/ALGORITHM.md §4.2), eager or on static buffers (captured in a CUDA graph when asked).

Shape legend: B sequences, T new tokens per sequence in one target forward, N tree nodes, n committed tokens (cache
length: an int shared by every row, or [B] per row), K cached keys a sliding-window layer looks at, V vocabulary,
Dm model width, Hkv key-value heads, D head dim, Tmax cache slots.
"""

from __future__ import annotations

import dataclasses

import torch

from longspec.infer.cache import StaticKVCache
from longspec.infer.graphs import StaticStep
from longspec.infer.tree import DraftTree
from longspec.modules import attention as attn_ops
from longspec.modules.attention import within_window
from longspec.modules.masks import aligned_rows

__all__ = ["TargetStep"]

# The most new tokens a chain's forward sends through the cache attention's causal tail (`TargetStep.forward`):
# chains of drafts are a few tokens (a lookup forest of 4 x 16 drafts: 65); the split-KV kernel is planned for
# few queries, not for prefill chunks.
MAX_CHAIN_TOKENS = 128


class TargetStep:
    """Owns the target's static KV cache (allocated once, grown only on need) and the static / captured steps
    that read its addresses (`static_step`): the engine's rounds (each drafts, verifies and commits in one), the
    ring's catch-up, and the draft / verify pieces the benchmarks time alone (the drafter cross-attends to the
    cache's last layer). Growing the cache drops them all."""

    def __init__(self, target):
        self.target = target
        self.device = target.embed_tokens.weight.device
        self.scales = [layer.self_attn.scaling for layer in target.layers]
        # A sliding-window layer reads new_mask even on a chain's path.
        self.windowed = any(w is not None for w in target.layer_windows)
        self.cache: StaticKVCache | None = None
        self.steps: dict[tuple, StaticStep] = {}  # static / captured steps by (kind, shape, capture, ...)
        self.epoch = 0  # how many times `steps` was dropped: who built steps ahead of time checks it

    def drop_steps(self) -> None:
        """Forget every static / captured step (they hold addresses of buffers about to be replaced)."""
        self.steps = {}
        self.epoch += 1

    def reserve(self, needed: int, batch_size: int = 1) -> None:
        """Allocate the cache once and reuse it across calls (reset to length 0), for any batch up to its rows
        (a smaller batch works on its first rows: `StaticKVCache.use_rows`); reallocate (and drop the captured
        graphs, which hold its addresses) only when a call needs more slots or more rows."""
        if self.cache is not None and self.cache.max_len >= needed and self.cache.capacity >= batch_size:
            self.cache.use_rows(batch_size)
            self.cache.reset()
            return
        # Free the old cache (and the steps that hold its addresses) before allocating: at 32K x batch 16 on the
        # 8B shape the two do not fit together. No local name may hold it here (one did, and kept it alive).
        self.cache = None
        self.drop_steps()
        self.cache = StaticKVCache.for_target(self.target, max_len=needed, batch_size=batch_size)

    def static_step(self, key, fn, inputs: tuple[torch.Tensor, ...], capture: bool, *, effects: bool = False):
        """Run fn on static buffers (built, and captured when asked, on first use) with the cache lengths
        mirrored on the device. Warm-up / capture calls of a forward or a draft only write pending cache slots:
        harmless. A step with lasting `effects` (a commit) warms up once, on this call's inputs, and that run
        is this call's (capture itself executes nothing)."""
        self.cache.sync_length()
        key = (*key, self.cache.batch_size)
        if key not in self.steps:
            step = StaticStep(fn, inputs, capture=capture, warmup=1 if effects else 2)
            self.steps[key] = step
            if effects and capture:
                return step.warmup_outputs
        return self.steps[key](*inputs)

    def lengths(self, static: bool) -> int | torch.Tensor:
        """The committed length n a forward or draft starts from: the host int when every row shares it (the
        eager case at batch 1), else the device lengths [B] (ragged rows, or static shapes: nothing read)."""
        cache = self.cache
        if static:  # synced by `static_step`, outside any capture (a fill inside one would replay stale)
            return cache.lengths_t
        if cache.uniform:
            return cache.length
        cache.sync_length()
        return cache.lengths_t

    def forward(
        self,
        tokens: torch.Tensor,
        offsets: torch.Tensor,
        new_mask: torch.Tensor | None,
        *,
        static: bool = False,
        chain: bool = False,
        branches: int = 1,
    ) -> torch.Tensor:
        """Target forward over T new tokens per row, tokens [B, T] at positions n + offsets [T], n = each row's
        committed length. new_mask [T, T] or [B, T, T] says which new tokens see which (a tree's ancestor mask);
        None means a causal chunk (prefill). `chain`: new_mask is causal (offsets 0..T-1, a chain tree), which
        the caller knows from the tree's shape; with `branches` > 1 it is that of `branches` chains from the first
        token, level by level (`tree.forest_parts`, a lookup forest). Every new token sees its row's whole
        committed prefix (within a sliding window where the layer has one). K/V land in the cache's pending slots; the caller commits.
        Returns hidden [B, T, Dm].

        n comes from the host (`cache.length`, eager, rows of one length) or from the device (`cache.lengths_t`:
        ragged rows, or static=True): then new K/V go to slots n + i by scatter, and a sliding-window layer
        gathers a fixed-size key window per row, so with static=True no host value is read and the forward can
        be captured in a CUDA graph."""
        cache, T = self.cache, tokens.shape[1]
        if not static:
            cache.check_room(T)
        n = self.lengths(static)
        on_device = isinstance(n, torch.Tensor)
        # Eager's fast case: the first prefill chunk is a square causal block, where the flash kernels apply.
        first_chunk = not on_device and new_mask is None and n == 0
        if new_mask is None:
            new_mask = offsets[None, :] <= offsets[:, None]  # causal
        # The pending slots each row's new K/V go to; the layers write them there themselves (in the RoPE
        # kernel on the packed path), before their attention reads the cache.
        slots = n[:, None] if on_device else torch.full((tokens.shape[0], 1), n, device=tokens.device)
        slots = slots + torch.arange(T, device=tokens.device)  # [B, T]
        windowed: dict[int, tuple[slice | torch.Tensor, torch.Tensor]] = {}
        # A short chain of new tokens (an AR step or a plain round when T = 1, a chain-shaped draft, PLD's drafts):
        # their K/V sit in slots [n, n + T) already, so new token t attends to the cache alone over [0, n + t]
        # (the split-KV kernel's causal tail) -- the same keys as the hybrid split, one kernel pair instead of
        # three; a lookup forest's tail sees the root and its own chain (the kernel's `branches`, from indices).
        # Prefill chunks keep the hybrid path: the split-KV kernel is for few queries.
        chained = not first_chunk and (T == 1 or (chain and T <= MAX_CHAIN_TOKENS))
        cache_len = n + T if chained else n
        if not chained or self.windowed:
            new_mask = aligned_rows(new_mask)  # once here, not in each layer's attention kernel

        def attn_fn(layer_idx, q, k, v):
            # [B, Hkv, Tmax, D], the new K/V already written
            keys, values = cache.keys[layer_idx], cache.values[layer_idx]
            window, scale = self.target.layer_windows[layer_idx], self.scales[layer_idx]
            if first_chunk and window is None:
                out, _ = attn_ops.attention(q, k, v, causal=True, scale=scale)
                return out
            if window is None and chained:
                out, _ = attn_ops.cache_attention(
                    q, keys, values, cache_len, causal=True, branches=branches, scale=scale
                )
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

        kv_cache = (cache.keys, cache.values, slots)
        return self.target(tokens, _positions(n, offsets), attn_fn=attn_fn, kv_cache=kv_cache).hidden

    def prefill(self, prompts: list[torch.Tensor], chunk_size: int) -> torch.Tensor:
        """Chunked prefill of every prompt into its cache row, committed chunk by chunk; returns each prompt's
        last-token logits [B, V] (what the first generated token is picked from). Prompts of different lengths
        share each chunk's forward: a shorter row is padded at its end, and its padding, written past its
        length, is never committed (causal attention keeps it out of the real tokens' view). A forward holds
        about `chunk_size` tokens in all (`chunk_len`): its activations do not grow with the batch."""
        lengths = [p.numel() for p in prompts]
        last: list[torch.Tensor | None] = [None] * len(prompts)
        chunk_size = chunk_len(chunk_size, len(prompts))
        for start in range(0, max(lengths), chunk_size):
            counts = [min(max(n - start, 0), chunk_size) for n in lengths]
            T = max(counts)
            tokens = torch.zeros(len(prompts), T, dtype=torch.long, device=self.device)
            for row, (prompt, count) in enumerate(zip(prompts, counts, strict=True)):
                tokens[row, :count] = prompt[start : start + count]
            hidden = self.forward(tokens, torch.arange(T, device=self.device), None)  # [B, T, Dm]
            for row, (n, count) in enumerate(zip(lengths, counts, strict=True)):
                if count and start + count == n:
                    last[row] = hidden[row, count - 1]
            self.cache.commit(counts)
        return self.target.logits(torch.stack(last))  # [B, V]

    def tree_logits(self, tree: DraftTree, *, static: bool = False) -> torch.Tensor:
        """ONE target forward over all tree nodes of every sequence's tree [B, N] -> logits [B, N, V] (node i
        predicts its children). Their K/V stay in the cache's pending slots until the round's commit. Runs as
        called: inside a round's static step (`RoundRunner.launch`), or eagerly."""
        hidden = self.forward(
            tree.tokens,
            tree.depths,
            tree.ancestor_mask,
            static=static,
            chain=tree.chain,
            branches=tree.branches,
        )
        return self.target.logits(hidden)

    def verify(self, tree: DraftTree, *, static: bool = False, capture: bool = False) -> torch.Tensor:
        """`tree_logits` as a step of its own: eager, or on static buffers (captured in a CUDA graph when asked;
        the logits are then the step's, valid until its next call). A round runs the forward inside its one
        step instead; this is the piece benchmarks/round_latency.py times alone."""
        if not static:
            return self.tree_logits(tree)

        def run(tokens, depths, ancestor_mask):
            on_buffers = dataclasses.replace(tree, tokens=tokens, depths=depths, ancestor_mask=ancestor_mask)
            return self.tree_logits(on_buffers, static=True)

        inputs = (tree.tokens, tree.depths, tree.ancestor_mask)
        key = ("verify", tree.num_nodes, tree.chain, tree.branches, capture)
        return self.static_step(key, run, inputs, capture)


def chunk_len(chunk_size: int, batch: int) -> int:
    """Prefill positions per forward for a batch: `chunk_size` tokens shared by the rows, so a forward's
    activations (the MLP's [tokens, intermediate] and the attention's per-chunk work) stay the same whatever the
    batch; per row they grew with it (16 rows x 4096 positions = 64K tokens a forward)."""
    return max(1, chunk_size // batch)


def prefill_slots(lengths: list[int], chunk_size: int) -> int:
    """Cache slots `TargetStep.prefill` writes for prompts of these lengths: a row whose prompt ended early
    still receives the later chunks' padding past its length."""
    most = 0
    chunk_size = chunk_len(chunk_size, len(lengths))
    for start in range(0, max(lengths), chunk_size):
        counts = [min(max(n - start, 0), chunk_size) for n in lengths]
        most = max(most, max(min(n, start) + max(counts) for n in lengths))
    return most


def _positions(n: int | torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Positions of new tokens at `offsets` [T] past n: [T] for a host n, [..., T] for a device n [...]."""
    return n[..., None] + offsets if isinstance(n, torch.Tensor) else n + offsets


def _window_keys(
    n: int | torch.Tensor, offsets: torch.Tensor, new_mask: torch.Tensor, window: int
) -> tuple[slice | torch.Tensor, torch.Tensor]:
    """(select, mask [..., T, K + T]) for a sliding-window layer's attention over the cache ++ T new tokens at
    positions n + offsets: `select` picks the K cached keys that may be in a query's window and the new ones;
    cached key j is visible iff it exists and within_window(n + offset, j); new tokens follow new_mask ([T, T]
    or [B, T, T]) within the window. Host n: the slice [max(0, n - window), n + T). Device n ([] or one per
    row [B]; static shapes, no host sync): slot indices [..., K + T], the `window` slots before n (clamped at 0,
    masked when they do not exist) then the T new ones."""
    T, device = offsets.shape[0], offsets.device
    if isinstance(n, torch.Tensor):
        cached = n[..., None] - window + torch.arange(window, device=device)  # may be < 0: no such key
        select = torch.cat([cached.clamp(min=0), n[..., None] + torch.arange(T, device=device)], dim=-1)
    else:
        lo = max(0, n - window)
        cached = torch.arange(lo, n, device=device)
        select = slice(lo, n + T)
    queries = _positions(n, offsets)  # [..., T]
    cache_part = (cached >= 0)[..., None, :] & within_window(
        queries[..., :, None], cached[..., None, :], window
    )
    new_part = new_mask & within_window(offsets[:, None], offsets[None, :], window)
    lead = torch.broadcast_shapes(cache_part.shape[:-2], new_part.shape[:-2])
    parts = [part.expand(*lead, *part.shape[-2:]) for part in (cache_part, new_part)]
    return select, torch.cat(parts, dim=-1)


def _take(keys: torch.Tensor, select: slice | torch.Tensor) -> torch.Tensor:
    """keys [B, Hkv, Tmax, D] at the slots `select`: a slice, or device indices [K] (every row) or [B, K] (one
    set per row), gathered on the device."""
    if isinstance(select, slice):
        return keys[:, :, select]
    if select.dim() == 1:
        return keys.index_select(2, select)
    B, Hkv, _, D = keys.shape
    return keys.gather(2, select[:, None, :, None].expand(B, Hkv, select.shape[1], D))
