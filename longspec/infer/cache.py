"""The target's static KV cache: allocated once, written in place, committed by length.

Shape legend: L layers, B batch, Hkv key/value heads, Tmax slots, D head dim, T new tokens, k accepted tokens.

Slots [0, length) hold the committed sequence. A forward over T new tokens (a prefill chunk, one AR token or a
draft tree) first `update`s its K/V into the pending slots [length, length + T) of every layer; then either
`commit(T)` keeps them all (prefill / AR), or `commit_path(indices)` keeps only the accepted tree nodes, moving
their K/V to [length, length + k) for all layers at once. Nothing is re-fed to the target after verification.
"""

from __future__ import annotations

import torch

__all__ = ["StaticKVCache"]


class StaticKVCache:
    """keys / values: [L, B, Hkv, Tmax, D] (one tensor each, so a commit is one gather per tensor)."""

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if max_len < 1:
            raise ValueError(f"KV cache max_len must be positive, got {max_len}")
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # committed tokens
        # Device mirror of `length` for static-shape steps (CUDA graphs read it; set by `sync_length`).
        self.length_t = torch.zeros((), dtype=torch.long, device=device)

    @classmethod
    def for_target(
        cls, target, *, max_len: int, batch_size: int = 1, dtype=None, device=None
    ) -> StaticKVCache:
        weight = target.embed_tokens.weight
        return cls(
            num_layers=target.num_layers,
            batch_size=batch_size,
            num_kv_heads=target.num_kv_heads,
            max_len=max_len,
            head_dim=target.head_dim,
            dtype=dtype or weight.dtype,
            device=device or weight.device,
        )

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def reset(self) -> None:
        self.length = 0
        self.length_t.zero_()

    def sync_length(self) -> None:
        """Copy `length` to `length_t` (a device write, no host sync) before a static-shape step."""
        self.length_t.fill_(self.length)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new K/V [B, Hkv, T, D] to the pending slots of one layer; return that layer's full
        (keys, values) [B, Hkv, Tmax, D] so attention can read [0, length + T)."""
        start, stop = self.length, self.length + k.shape[2]
        if stop > self.max_len:
            raise ValueError(
                f"KV cache overflow: {stop} tokens > max_len {self.max_len}; raise the engine's max_len"
            )
        self.keys[layer_idx, :, :, start:stop] = k
        self.values[layer_idx, :, :, start:stop] = v
        return self.keys[layer_idx], self.values[layer_idx]

    def update_static(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` for static-shape steps: slots [T] = length_t + arange(T) are device indices (no host
        value needed, so the step can be captured in a CUDA graph). No overflow check: callers size the cache."""
        self.keys[layer_idx].index_copy_(2, slots, k)
        self.values[layer_idx].index_copy_(2, slots, v)
        return self.keys[layer_idx], self.values[layer_idx]

    def commit(self, num_tokens: int) -> None:
        """Keep all pending tokens written by the last forward (prefill chunk, AR step)."""
        assert self.length + num_tokens <= self.max_len
        self.length += num_tokens

    def commit_path(self, node_indices: torch.Tensor) -> None:
        """Keep only the accepted tree nodes: pending slot length + node_indices[i] -> slot length + i, all layers.

        node_indices [k] ascending (a root-first path); the gather reads before it writes, so overlap is safe."""
        k = node_indices.shape[0]
        src = node_indices.to(self.keys.device) + self.length
        dst = slice(self.length, self.length + k)
        self.keys[:, :, :, dst] = self.keys.index_select(3, src)
        self.values[:, :, :, dst] = self.values.index_select(3, src)
        self.length += k
