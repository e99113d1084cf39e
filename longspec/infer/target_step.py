"""The target side of a round: the static KV cache, the chunked prefill and the ONE verify forward over a draft
tree (docs/ALGORITHM.md §4.2), eager or on static buffers (captured in a CUDA graph when asked).

Shape legend: T new tokens in one target forward, N tree nodes, n committed tokens (cache length), K cached keys a
sliding-window layer looks at, V vocabulary, Dm model width, Hkv key-value heads, D head dim, Tmax cache slots.
"""

from __future__ import annotations

import torch

from longspec.infer.cache import StaticKVCache
from longspec.infer.graphs import StaticStep
from longspec.infer.tree import DraftTree
from longspec.modules import attention as attn_ops
from longspec.modules.attention import within_window

__all__ = ["TargetStep"]


class TargetStep:
    """Owns the target's static KV cache (allocated once, grown only on need) and the static / captured steps
    that read its addresses: the verify forwards and, through `static_step`, the draft steps (the drafter
    cross-attends to the cache's last layer). Growing the cache drops them all."""

    def __init__(self, target):
        self.target = target
        self.device = target.embed_tokens.weight.device
        self.scales = [layer.self_attn.scaling for layer in target.layers]
        self.cache: StaticKVCache | None = None
        self.steps: dict[tuple, StaticStep] = {}  # static / captured steps by (kind, shape, capture, ...)

    def reserve(self, needed: int) -> None:
        """Allocate the cache once and reuse it across calls (reset to length 0); grow (and drop captured graphs,
        which hold its addresses) only when a call needs more slots."""
        if self.cache is not None and self.cache.max_len >= needed:
            self.cache.reset()
            return
        self.cache = None  # free the old one first
        self.steps = {}
        self.cache = StaticKVCache.for_target(self.target, max_len=needed)

    def static_step(self, key, fn, inputs: tuple[torch.Tensor, ...], capture: bool):
        """Run fn on static buffers (built, and captured when asked, on first use) with the cache length
        mirrored on the device. Warm-up / capture calls only write pending cache slots: harmless."""
        self.cache.sync_length()
        if key not in self.steps:
            self.steps[key] = StaticStep(fn, inputs, capture=capture)
        return self.steps[key](*inputs)

    def forward(
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

    def prefill(self, prompt: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """Chunked prefill of the whole prompt into the (reserved) cache, committed chunk by chunk; returns the
        last prompt token's logits [1, V] (what the first generated token is picked from)."""
        hidden = None
        for start in range(0, prompt.numel(), chunk_size):
            chunk = prompt[start : start + chunk_size]
            hidden = self.forward(chunk, torch.arange(chunk.numel(), device=self.device), None)
            self.cache.commit(chunk.numel())
        return self.target.logits(hidden[-1:])  # [1, V]

    def verify(
        self,
        tree: DraftTree,
        *,
        static: bool = False,
        capture: bool = False,
        head=None,
        head_inputs: tuple[torch.Tensor, ...] = (),
        head_key: tuple = (),
    ):
        """ONE target forward over all tree nodes -> logits [N, V] (node i predicts its children). Their K/V
        stay in the cache's pending slots until `cache.commit_path`. static / capture: see GenerationConfig.

        `head(logits, tokens, depths, ancestor_mask, *head_inputs)`, when given, is what the round does with the
        logits (its acceptance rule) and its result is returned instead. It runs inside the same step, so with
        graphs the logits never leave the graph and the rule's many small kernels replay with the forward in one
        launch (on the H200 the eager sampling rule made a round cost 28.8 ms against 8.1 ms greedy). `head_key`
        names what the head closes over (a step is built once per key)."""

        def run(tokens, offsets, new_mask, *extra):
            logits = self.target.logits(self.forward(tokens, offsets, new_mask, static=static))
            return logits if head is None else head(logits, tokens, offsets, new_mask, *extra)

        inputs = (tree.tokens, tree.depths, tree.ancestor_mask, *head_inputs)
        if not static:
            return run(*inputs)
        return self.static_step(("verify", tree.num_nodes, capture, head_key), run, inputs, capture)


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
