"""Atomic, resumable training checkpoints.

Layout of <run_dir>/checkpoints/step_00000200/:
    ds/                      DeepSpeed engine state: drafter weights, optimizer, LR scheduler (frozen target excluded)
    drafter/                 Drafter.save_pretrained of the weights at this step (what `longspec.export` ships)
    rng/rank_00000.json      every rank's torch / CUDA / numpy / python RNG states
    trainer_state.json       step, tokens seen, data position, ... -- written last
All ranks write into `.tmp-step_00000200`; after a barrier rank 0 renames it into place (atomic on POSIX), so a
directory named step_* is always complete and a run killed mid-save (even by SIGKILL) resumes from the previous
one. Old checkpoints are renamed to a temp name before deletion for the same reason.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from longspec.data.manifest import write_json_atomic

__all__ = ["CheckpointManager", "rng_state", "set_rng_state"]

log = logging.getLogger("longspec.train")
STATE_NAME = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def rng_state() -> dict[str, Any]:
    """JSON-able RNG states of this process (no pickles: resume never unpickles)."""
    np_state = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(
            torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8)
        )


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    def __init__(self, run_dir: str, *, keep_last: int, rank: int):
        self.root = os.path.join(run_dir, "checkpoints")
        self.keep_last = keep_last
        self.rank = rank

    def step_dirs(self) -> list[tuple[int, str]]:
        """Complete checkpoints, oldest first."""
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            match = _STEP_DIR.match(name)
            if match and os.path.isfile(os.path.join(self.root, name, STATE_NAME)):
                found.append((int(match.group(1)), os.path.join(self.root, name)))
        return sorted(found)

    def latest(self) -> str | None:
        dirs = self.step_dirs()
        return dirs[-1][1] if dirs else None

    def remove_partial(self) -> None:
        """Rank 0, at start-up: delete temp dirs left by a run killed while saving."""
        if self.rank == 0 and os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(".tmp-"):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        _barrier()

    def save(self, step: int, engine, save_drafter, trainer_state: dict[str, Any]) -> str:
        """Collective: every rank calls it. `save_drafter(dir)` writes the drafter weights (rank 0 writes)."""
        name = f"step_{step:08d}"
        tmp, final = os.path.join(self.root, f".tmp-{name}"), os.path.join(self.root, name)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"))
        _barrier()
        engine.save_checkpoint(tmp, tag="ds", save_latest=False, exclude_frozen_parameters=True)
        save_drafter(os.path.join(tmp, "drafter"))
        with open(os.path.join(tmp, "rng", f"rank_{self.rank:05d}.json"), "w") as f:
            json.dump(rng_state(), f)
        _barrier()
        if self.rank == 0:
            write_json_atomic(os.path.join(tmp, STATE_NAME), {"step": step, **trainer_state})
            _fsync_dir(tmp)
            if os.path.exists(final):  # the same step saved by an earlier, interrupted attempt
                os.rename(final, os.path.join(self.root, f".tmp-old-{name}"))
                shutil.rmtree(os.path.join(self.root, f".tmp-old-{name}"))
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._prune()
            log.info("saved checkpoint %s", final)
        _barrier()
        return final

    def _prune(self) -> None:
        for _, path in self.step_dirs()[: -self.keep_last]:
            doomed = os.path.join(self.root, ".tmp-old-" + os.path.basename(path))
            os.rename(path, doomed)  # atomic: never a half-deleted step_* dir
            shutil.rmtree(doomed)

    def load(self, path: str, engine) -> dict[str, Any]:
        """Restore engine state and this rank's RNG from a checkpoint dir; returns the trainer state."""
        load_path, _ = engine.load_checkpoint(
            path,
            tag="ds",
            load_module_strict=False,  # the frozen target is not in the checkpoint: it comes from target.path
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if load_path is None:
            raise FileNotFoundError(f"DeepSpeed could not load the engine state from {path}/ds")
        rng_path = os.path.join(path, "rng", f"rank_{self.rank:05d}.json")
        if not os.path.isfile(rng_path):
            raise ValueError(
                f"{path} has no RNG state for rank {self.rank}: resume with the same number of processes"
            )
        with open(rng_path) as f:
            set_rng_state(json.load(f))
        with open(os.path.join(path, STATE_NAME)) as f:
            return json.load(f)
