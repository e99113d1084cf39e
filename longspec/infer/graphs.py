"""Steps with static shapes, optionally captured in a CUDA graph.

Decoding at batch 1 is launch-bound: a decode step's Python and kernel launches cost far more than reading its
weights. A round has fixed shapes (N tree nodes, the ring buffer's W slots, the
cache length kept on the device), so its draft and its target forward can each be recorded once and replayed
with a single launch.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["StaticStep", "no_gc"]


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was after). A collection during a capture may
    free a dead engine's captured graphs, and destroying a graph while a stream captures invalidates the
    capture ("operation not permitted when stream is capturing"): seen on the GPU when one test's engines,
    freed only by the cyclic collector, were collected during the next test's capture. Recent torch (2.11 in
    those runs) no longer collects before a capture itself (torch.compiler.config.force_cudagraph_gc).

    Decoding runs under it too (the engine's decode loop, the eval's timed runs): a full collection walks every
    object the process holds, and with a model, its tokenizer and an evaluation's data loaded, it stalls a decode
    for far longer than a round. A decode loop frees its
    objects by reference counting; the few cycles it leaves are collected at the next collection after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class StaticStep:
    """fn(*buffers) run on static input buffers shaped like `example_inputs`.

    capture=True (CUDA only) records fn in a CUDA graph after `warmup` eager calls on a side stream (which
    also lets Triton compile and autotune outside the capture); each call then copies its inputs into the
    buffers and replays. Outputs are the graph's static tensors: consume them before the next call.
    capture=False runs fn eagerly on the same buffers: the CPU-testable twin of the captured path, down to its
    outputs: they are copied into static tensors too, which the next call overwrites, as a replay does. (A
    round that read its previous round's graph output after that graph replayed again, the roots of a plain
    round, was wrong on the GPU only, while the twin handed out fresh tensors.)
    fn must not read host values from the device, nor change shapes between calls. A step whose calls change
    state for good (a commit) is built with warmup=1 on the call's real inputs: that warm-up IS the call."""

    def __init__(
        self, fn: Callable, example_inputs: Sequence[torch.Tensor], *, capture: bool, warmup: int = 2
    ):
        self.fn = fn
        self.inputs = tuple(x.clone() for x in example_inputs)
        self.graph = None
        self.outputs = None
        self.warmup_outputs = None  # what the last warm-up call returned
        if not capture:
            return
        device = self.inputs[0].device
        if device.type != "cuda":
            raise ValueError("CUDA graphs need CUDA tensors")
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.warmup_outputs = fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with no_gc(), torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor):
        for buffer, value in zip(self.inputs, inputs, strict=True):
            buffer.copy_(value)
        if self.graph is None:
            self.outputs = _into(self.outputs, self.fn(*self.inputs))
            return self.outputs
        self.graph.replay()
        return self.outputs


def _into(static, new):
    """`new` (a tensor, or a tuple / list of them, or None) copied into `static`'s tensors (cloned the first time,
    `static` None): what a captured graph's outputs are, the same tensors every call."""
    if new is None:
        return None
    if isinstance(new, torch.Tensor):
        return new.clone() if static is None else static.copy_(new)
    olds = [None] * len(new) if static is None else static
    return type(new)(_into(old, part) for old, part in zip(olds, new, strict=True))
