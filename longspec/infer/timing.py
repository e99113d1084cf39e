"""Where a generation's time goes: prefill, decode and the round's phases (draft / verify / overhead), measured
without adding host syncs to the rounds (CUDA events on the GPU, read once per call).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from longspec.infer.stats import GenerationStats

__all__ = ["PhaseClock", "now", "timer"]


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
