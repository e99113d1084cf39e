"""An evaluation's finished samples, kept as they complete so that a stopped run loses none of them.

A long evaluation (hundreds of 32K-128K-token samples on a large target) can take hours; a job's time limit, a
preempted node or a crash must not lose every sample decoded before it. Each finished chunk of samples (one batch:
every method's records, after the lossless check) is appended as one JSON line to OUT/results.partial.jsonl and
flushed to disk. A rerun with the same configuration reads those chunks back instead of decoding them again and
continues with the rest; results.json then holds all of them (`resumed` counts those read back: their times were
measured by the earlier process). The file is removed once results.json is written.

The first line is the run's key (`run_key`): a hash of the eval config, of the samples (their ids and prompt
token ids: the data's content, whatever file or dataset it came from), of the target (its fingerprint and its
files' names, sizes and modification times) and of the drafter's files (their content). A file with another key
(another config, a changed data file, a replaced target, a re-exported drafter) is discarded, not mixed in.
A line cut short by a kill mid-write is ignored, with the lines after it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import numpy as np

__all__ = ["PARTIAL_NAME", "EvalProgress", "run_key"]

logger = logging.getLogger("longspec.eval")

PARTIAL_NAME = "results.partial.jsonl"


def _files(path: str | None, *, content: bool) -> list[list]:
    """[name, size, mtime_ns] of each file of a directory (or of one file), or [name, sha256] when `content`;
    [] for a path that is not local (a hub id)."""
    if not path or not os.path.exists(path):
        return []
    if os.path.isdir(path):
        root, names = path, sorted(os.listdir(path))
    else:
        root, name = os.path.split(path)
        names = [name]
    found = []
    for name in names:
        full = os.path.join(root, name)
        if not os.path.isfile(full):
            continue
        if content:
            with open(full, "rb") as f:
                found.append([name, hashlib.file_digest(f, "sha256").hexdigest()])
        else:
            stat = os.stat(full)
            found.append([name, stat.st_size, stat.st_mtime_ns])
    return found


def run_key(
    config: dict,
    datasets: list[tuple[str, list]],
    *,
    target: dict,
    target_path: str | None,
    drafter_dir: str | None,
) -> str:
    """What must not change between a stopped run and its continuation: the eval config (as results.json records
    it), the samples (`datasets`: (name, [Sample])), the target (`target`: its fingerprint; `target_path`: its
    directory or GGUF file) and the drafter's files (their bytes: a drafter is one block, cheap to hash; a
    target is not, so its files count by size and modification time)."""
    data = hashlib.sha256()
    for name, samples in datasets:
        for sample in samples:
            data.update(json.dumps([name, sample.id]).encode())
            data.update(np.asarray(sample.prompt_ids, dtype=np.int64).tobytes())
    blob = json.dumps(
        {
            "config": config,
            "data_sha256": data.hexdigest(),
            "target": target,
            "target_files": _files(target_path, content=False),
            "drafter_files": _files(drafter_dir, content=True),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


class EvalProgress:
    """The finished chunks of one run (see the module docstring): `get` those a stopped run left, `add` each new
    one as it completes, `finish` once results.json is written."""

    def __init__(self, output_dir: str, key: str):
        self.path = os.path.join(output_dir, PARTIAL_NAME)
        self.key = key
        self.done: dict[tuple[str, int], dict[str, list[dict]]] = {}
        if os.path.isfile(self.path):
            self._load()
        if not self.done:  # nothing to continue: a fresh file, headed by this run's key
            os.makedirs(output_dir, exist_ok=True)
            with open(self.path, "w") as f:
                f.write(json.dumps({"key": key}) + "\n")

    def _load(self) -> None:
        with open(self.path) as f:
            lines = f.read().split("\n")
        try:
            header = json.loads(lines[0])
        except json.JSONDecodeError:
            header = {}
        if header.get("key") != self.key:
            logger.warning(
                "%s was written for another configuration, data, target or drafter: starting over", self.path
            )
            return
        kept = 1
        for line in lines[1:]:
            try:
                chunk = json.loads(line)
            except json.JSONDecodeError:  # the line a kill cut short (or the empty tail): nothing after it
                break
            self.done[(chunk["dataset"], chunk["start"])] = chunk["records"]
            kept += 1
        # Rewritten without a cut line, so the next append starts a line of its own.
        with open(self.path, "w") as f:
            f.write("\n".join(lines[:kept]) + "\n")
        if self.done:
            logger.info(
                "%s: continuing a stopped run, %d finished chunk(s) read back", self.path, len(self.done)
            )

    def get(self, dataset: str, start: int) -> dict[str, list[dict]] | None:
        """Every method's records of the chunk of `dataset` starting at sample `start`, if a stopped run finished
        it."""
        return self.done.get((dataset, start))

    def add(self, dataset: str, start: int, records: dict[str, list[dict]]) -> None:
        """A finished chunk, on disk before the next one starts."""
        with open(self.path, "a") as f:
            f.write(json.dumps({"dataset": dataset, "start": start, "records": records}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def finish(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)
