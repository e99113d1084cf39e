"""Run logging: one console line per step on rank 0, metrics.jsonl, and optional Weights & Biases.

Everything goes through `MetricsLogger.log(step, record)`; sinks are tiny classes so W&B stays optional and off
unless `logging.wandb` is offline/online.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Protocol

__all__ = ["MetricsSink", "JsonlSink", "WandbSink", "MetricsLogger", "setup_logging", "truncate_metrics"]

log = logging.getLogger("longspec.train")
METRICS_NAME = "metrics.jsonl"


def setup_logging(run_dir: str | None, rank: int) -> None:
    """stdlib logging once: rank 0 logs INFO to stderr and <run_dir>/train.log; other ranks only warnings."""
    root = logging.getLogger("longspec")
    root.handlers.clear()
    root.propagate = False
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if rank == 0 and run_dir is not None:
        handlers.append(logging.FileHandler(os.path.join(run_dir, "train.log")))
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)


class MetricsSink(Protocol):
    def write(self, step: int, record: dict[str, Any]) -> None: ...

    def sync(self) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per optimizer step, flushed each line (a killed run loses at most the line in flight)."""

    def __init__(self, path: str):
        self._file = open(path, "a", encoding="utf-8")

    def write(self, step: int, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, **record}) + "\n")
        self._file.flush()

    def sync(self) -> None:
        """On disk before a checkpoint is committed: a checkpoint never claims steps metrics.jsonl lacks."""
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class WandbSink:
    def __init__(self, *, mode: str, project: str, name: str, run_dir: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError as e:
            raise ValueError("logging.wandb needs the wandb package: `pip install wandb`") from e
        # A stable id per run directory: a resumed run continues the same W&B run instead of starting a new one.
        run_id = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
        self._run = wandb.init(
            mode=mode, project=project, name=name, dir=run_dir, config=config, id=run_id, resume="allow"
        )

    def write(self, step: int, record: dict[str, Any]) -> None:
        self._run.log(record, step=step)

    def sync(self) -> None:
        pass  # W&B buffers and retries on its own

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    """Fans a step's record out to the sinks and prints the console line (rank 0 only; other ranks no-op)."""

    def __init__(self, sinks: list[MetricsSink], *, log_every: int):
        self.sinks = sinks
        self.log_every = log_every

    def log(self, step: int, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(step, record)
        if step % self.log_every == 0:
            log.info(format_line(step, record))

    def sync(self) -> None:
        for sink in self.sinks:
            sink.sync()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def format_line(step: int, r: dict[str, Any]) -> str:
    parts = [f"step {step}/{r.get('total_steps', '?')}", f"loss {r['loss']:.4f}"]
    if r.get("kl") is not None:
        parts.append(f"kl {r['kl']:.4f}")
    if r.get("acc") is not None:
        parts.append(f"acc {r['acc']:.3f}")
    parts += [
        f"gnorm {r['grad_norm']:.3f}",
        f"lr {r['lr']:.2e}",
        f"tok/s {r['tokens_per_s']:,.0f}",
        f"mem {r['mem_gb']:.1f}GB",
        f"{r['step_time_s'] * 1000:.0f}ms",
    ]
    return " | ".join(parts)


def truncate_metrics(run_dir: str, last_step: int) -> list[int]:
    """Make metrics.jsonl hold each step 1..`last_step` (the checkpoint resumed from) exactly once, in order.

    Records past `last_step` are dropped (those steps are redone), and so are lines a killed run left half
    written. Appends stay the cheap per-step write; this one rewrite (temp file + rename) runs at resume, so a kill
    during it leaves the old file. A step written twice keeps its last record. Returns the steps <= `last_step`
    that no record covers (logged as a warning: the metrics of those steps are lost, the training is not)."""
    path = os.path.join(run_dir, METRICS_NAME)
    if not os.path.exists(path):
        return list(range(1, last_step + 1))
    by_step: dict[int, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, TypeError, KeyError):
                continue  # a line a killed run was writing
            if 1 <= step <= last_step:
                by_step[step] = json.dumps(record) + "\n"
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(by_step[step] for step in sorted(by_step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    missing = [step for step in range(1, last_step + 1) if step not in by_step]
    if missing:
        log.warning("%s has no record of steps %s", path, _ranges(missing))
    return missing


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    parts, start = [], steps[0]
    for prev, cur in zip(steps, steps[1:] + [None], strict=True):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)
