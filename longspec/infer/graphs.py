"""A target step with static shapes, optionally captured in a CUDA graph.

Shape legend: T tokens per step (fixed per step object), V vocabulary.

Decoding at batch 1 is launch-bound: an 8B model's decode step is ~40 ms of Python and kernel launches over a
~4 ms bytes floor (docs/BENCHMARKS.md). A round has fixed shapes (T tree nodes, the cache length lives on the device),
so its whole target forward can be recorded once and replayed with a single launch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["StaticStep"]

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class StaticStep:
    """fn(tokens [T], offsets [T], mask [T, T]) -> logits [T, V], run on static input buffers.

    capture=True (CUDA only) records fn in a CUDA graph after `warmup` eager calls (which also let Triton
    autotune outside the capture); calls then copy the inputs into the buffers and replay. The returned logits
    are the graph's static output: consume them before the next call. capture=False runs fn eagerly on the same
    buffers (the CPU-testable twin of the captured path). fn must not sync with the host or change shapes."""

    def __init__(self, fn: StepFn, num_tokens: int, device: torch.device, *, capture: bool, warmup: int = 2):
        self.fn = fn
        self.tokens = torch.zeros(num_tokens, dtype=torch.long, device=device)
        self.offsets = torch.arange(num_tokens, device=device)
        self.mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril()
        self.graph = None
        self.out = None
        if capture:
            if device.type != "cuda":
                raise ValueError("CUDA graphs need a CUDA device")
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    fn(self.tokens, self.offsets, self.mask)
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = fn(self.tokens, self.offsets, self.mask)

    def __call__(self, tokens: torch.Tensor, offsets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.offsets.copy_(offsets)
        self.mask.copy_(mask)
        if self.graph is None:
            return self.fn(self.tokens, self.offsets, self.mask)
        self.graph.replay()
        return self.out
