"""Atomic, resumable training checkpoints.

Layout of <run_dir>/checkpoints/step_00000200/:
    ds/                      DeepSpeed engine state: drafter weights, optimizer, LR scheduler (frozen target excluded)
    drafter/                 Drafter.save_pretrained of the weights at this step (what `longspec.export` ships)
    rng/rank_00000.json      every rank's torch / CUDA / numpy / python RNG states
    trainer_state.json       step, tokens seen, the run's inputs (`inputs.run_inputs`: what `preflight` compares)
    checksums.json           sha256 and size of every other file -- written last
All ranks write into `.tmp-step_00000200`; after a barrier rank 0 renames it into place (atomic on POSIX), so a
directory named step_* is always complete and a run killed mid-save (even by SIGKILL) resumes from the previous
one. Old checkpoints are renamed to a temp name before deletion for the same reason. A step_* directory that is not
whole was damaged after it was written: it is listed as a checkpoint all the same, so that a resume or an export
refuses it by name instead of silently taking an older one (or none, and starting over the run's metrics).

Trust: the RNG states and trainer state are JSON, the drafter weights safetensors, but DeepSpeed's `ds/*.pt`
are pickles that `engine.load_checkpoint` unpickles (torch.load(weights_only=False)). Before anything is
unpickled, `verify_checkpoint` checks every file against checksums.json and refuses a missing, changed, truncated
or unlisted file. That catches corruption and files mixed in from elsewhere, not an attacker who can rewrite the
run directory (checksums included): resume only run directories you trust (docs/ARCHITECTURE.md, failure model).
"""

from __future__ import annotations

import base64
import hashlib
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

from longspec.atomic import write_json_atomic
from longspec.cli import write_failure

__all__ = [
    "CheckpointManager",
    "RUN_KIND",
    "CHECKSUMS_NAME",
    "CheckpointError",
    "RESUME_KEYS",
    "STATE_NAME",
    "checkpoints_root",
    "checkpoint_dir",
    "done_marker",
    "drafter_dir",
    "latest_checkpoint",
    "list_checkpoints",
    "read_trainer_state",
    "rng_state",
    "set_rng_state",
    "verify_checkpoint",
]

log = logging.getLogger("longspec.train")
CHECKPOINTS_NAME = "checkpoints"
STATE_NAME = "trainer_state.json"
CHECKSUMS_NAME = "checksums.json"
RUN_KIND = "training run"  # the ownership marker's kind of a run directory (longspec.ownership)
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# What a resume reads from trainer_state.json (and so requires, as integers).
RESUME_KEYS = ("step", "tokens_seen", "total_steps", "world_size")


# ---- the layout: the one place that knows it (export, preflight and the pipeline call these) ----------------
def checkpoints_root(run_dir: str) -> str:
    """<run_dir>/checkpoints: every checkpoint of a run, and nothing else of it."""
    return os.path.join(run_dir, CHECKPOINTS_NAME)


def checkpoint_dir(run_dir: str, step: int) -> str:
    """Where the checkpoint of optimizer step `step` lives (complete only once `done_marker` exists)."""
    return os.path.join(checkpoints_root(run_dir), f"step_{step:08d}")


def done_marker(run_dir: str, step: int) -> str:
    """The file whose presence marks step `step`'s checkpoint complete: trainer_state.json, which is inside the temp
    dir when that is renamed into place, so it exists only in a whole checkpoint."""
    return os.path.join(checkpoint_dir(run_dir, step), STATE_NAME)


def drafter_dir(checkpoint: str) -> str:
    """The Drafter.save_pretrained directory inside a checkpoint dir (what `longspec.export` ships)."""
    return os.path.join(checkpoint, "drafter")


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint of `run_dir` (every step_* directory: whole when written, see the module
    docstring), oldest first ([] when there is none)."""
    root = checkpoints_root(run_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest_checkpoint(run_dir: str) -> str | None:
    """The newest checkpoint dir of `run_dir`, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def read_trainer_state(checkpoint: str, required: tuple[str, ...] = ("step",)) -> dict[str, Any]:
    """The trainer state (step, tokens seen, target, data, stage, world size, ...) a checkpoint dir was saved with.
    A missing or malformed file, or one without an integer for each of `required`, is a CheckpointError naming it
    (read it only after `verify_checkpoint`, where the checkpoint has checksums)."""
    path = os.path.join(checkpoint, STATE_NAME)
    fix = f"the checkpoint is corrupt: remove {checkpoint} to resume from the one before it"
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; {fix}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a JSON object; {fix}")
    for key in required:
        if not isinstance(state.get(key), int) or isinstance(state.get(key), bool):
            raise CheckpointError(f"{path} has no integer {key!r}; {fix}")
    return state


def rng_state() -> dict[str, Any]:
    """JSON-able RNG states of this process (JSON, not pickles; DeepSpeed's ds/*.pt are the only pickles)."""
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


class CheckpointError(ValueError):
    """A checkpoint that does not match its checksums (one line naming the file; no traceback)."""


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files_under(root: str) -> list[str]:
    """Every file below `root`, as sorted '/'-separated relative paths (the manifest excluded)."""
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(directory, name), root).replace(os.sep, "/")
            if rel != CHECKSUMS_NAME:
                found.append(rel)
    return sorted(found)


def write_checksums(path: str) -> None:
    """Record sha256 + size of every file of the checkpoint dir `path` (atomically; the last file written)."""
    files = {}
    for rel in _files_under(path):
        full = os.path.join(path, rel)
        files[rel] = {"sha256": _sha256(full), "bytes": os.path.getsize(full)}
    write_json_atomic(os.path.join(path, CHECKSUMS_NAME), {"format": 1, "files": files})


def verify_checkpoint(path: str, only: list[str] | None = None, *, purpose: str = "resume") -> None:
    """Raise CheckpointError unless every file of `path` is listed in its checksums.json with that content, and
    every listed file exists. Reads bytes only: nothing is unpickled. `only`: check just these files (paths
    relative to `path`; export reads the drafter's two and nothing else). `purpose`: what a refusal refuses."""
    manifest_path = os.path.join(path, CHECKSUMS_NAME)
    try:
        with open(manifest_path) as f:
            listed = json.load(f)["files"]
    except FileNotFoundError:
        raise CheckpointError(
            f"{manifest_path} is missing: the checkpoint cannot be verified before DeepSpeed unpickles it "
            "(written by an older version, or not by this trainer); start a new output_dir with init_from= an "
            "exported drafter"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path} is not a valid checksum manifest ({e})") from None
    if not isinstance(listed, dict):
        raise CheckpointError(f"{manifest_path} is not a valid checksum manifest (no files table)")
    for rel, entry in listed.items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and isinstance(entry.get("sha256"), str)
        ):
            raise CheckpointError(
                f"{manifest_path} is not a valid checksum manifest (the entry of {rel!r} lacks 'bytes' or 'sha256')"
            )
    present = _files_under(path)
    if only is not None:
        unlisted = [rel for rel in only if rel not in listed]
        if unlisted:
            raise CheckpointError(
                f"{os.path.join(path, unlisted[0])} is not in {CHECKSUMS_NAME}: refusing to {purpose}"
            )
        listed = {rel: listed[rel] for rel in only}
    for rel in present if only is None else ():
        if rel not in listed:
            raise CheckpointError(
                f"{os.path.join(path, rel)} is not in {CHECKSUMS_NAME}: refusing to {purpose}"
            )
    for rel, expected in sorted(listed.items()):
        full = os.path.join(path, rel)
        if rel not in present:
            raise CheckpointError(
                f"{full} is missing (listed in {CHECKSUMS_NAME}): the checkpoint is incomplete"
            )
        if os.path.getsize(full) != expected["bytes"] or _sha256(full) != expected["sha256"]:
            raise CheckpointError(
                f"{full} does not match its checksum in {CHECKSUMS_NAME} (truncated or changed): refusing to {purpose}"
            )


class CheckpointManager:
    def __init__(self, run_dir: str, *, keep_last: int, rank: int):
        self.run_dir = run_dir
        self.root = checkpoints_root(run_dir)
        self.keep_last = keep_last
        self.rank = rank

    def latest(self) -> str | None:
        return latest_checkpoint(self.run_dir)

    def remove_partial(self) -> None:
        """Rank 0, at start-up: delete temp dirs left by a run killed while saving."""
        if self.rank == 0 and os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(".tmp-"):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        _barrier()

    def save(self, step: int, engine, save_drafter, trainer_state: dict[str, Any]) -> str:
        """Collective: every rank calls it. `save_drafter(dir)` writes the drafter weights (rank 0 writes)."""
        final = checkpoint_dir(self.run_dir, step)
        name = os.path.basename(final)
        tmp = os.path.join(self.root, f".tmp-{name}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"))
        _barrier()
        try:
            engine.save_checkpoint(tmp, tag="ds", save_latest=False, exclude_frozen_parameters=True)
            save_drafter(drafter_dir(tmp))
            with open(os.path.join(tmp, "rng", f"rank_{self.rank:05d}.json"), "w") as f:
                json.dump(rng_state(), f)
            _barrier()
            if self.rank == 0:
                write_json_atomic(os.path.join(tmp, STATE_NAME), {"step": step, **trainer_state})
                write_checksums(tmp)
                _fsync_dir(tmp)
        except Exception as e:  # a full disk, a read-only folder: no half checkpoint left, the cause named
            shutil.rmtree(tmp, ignore_errors=True)
            cause = write_failure(e, self.root)
            if cause is not e:
                raise cause from None
            raise
        if self.rank == 0:
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
        for _, path in list_checkpoints(self.run_dir)[: -self.keep_last]:
            doomed = os.path.join(self.root, ".tmp-old-" + os.path.basename(path))
            os.rename(path, doomed)  # atomic: never a half-deleted step_* dir
            shutil.rmtree(doomed)

    def load(self, path: str, engine) -> dict[str, Any]:
        """Restore engine state and this rank's RNG from a checkpoint dir; returns the trainer state. The caller
        has verified the checksums (`verify_checkpoint`: DeepSpeed's ds/*.pt are pickles): the Trainer checks
        before it loads the model, under the run lock, so nothing rewrites them in between."""
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
        return read_trainer_state(path, RESUME_KEYS)
