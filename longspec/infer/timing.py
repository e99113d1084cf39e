"""Where a generation's time goes: prefill, decode and the round's phases (draft / verify / overhead), measured
without adding host syncs to the rounds (CUDA events on the GPU, read once per call).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from longspec.infer.stats import GenerationStats

__all__ = ["PhaseClock", "gc_paused", "now", "timer"]


def now(device: torch.device) -> float:
    """Wall time once `device` has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: phase timing needs the GPU to have finished
    return time.perf_counter()


class PhaseClock:
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
def timer(stats: GenerationStats, name: str, device: torch.device) -> Iterator[None]:
    """Add the block's synced wall time to `stats.<name>` (e.g. "prefill_s")."""
    start = now(device)
    yield
    setattr(stats, name, getattr(stats, name) + now(device) - start)


@contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic garbage collection inside the block (the state before it is restored after it). A full
    collection walks every object the process holds: with a model, its tokenizer and an evaluation's data
    loaded, one stalled a decode on the GPU for 300-340 ms, once in a T=1 evaluation's first AR sample (297 tok/s
    where the others ran 915) and once inside a speculating round (338 ms where its neighbours took 1.4;
    docs/BENCHMARKS.md). A decode loop frees its objects by reference counting; the few cycles it leaves are
    collected at the next automatic collection after the block."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
