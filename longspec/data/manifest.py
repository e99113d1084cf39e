"""The manifest that describes one prepared dataset directory, and the tokenizer fingerprint stored in it.

The manifest is the record of a prep run: where the rows came from, how many were kept or rejected and why, how
many tokens went into which shard, and which tokenizer produced them, so the trainer can refuse data tokenized
for another target. It is written last (atomically), so a directory without `complete: true` is an interrupted
prep and is never trained on.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from longspec.atomic import write_json_atomic
from longspec.fingerprint import tokenizer_hash

__all__ = [
    "MANIFEST_NAME",
    "FORMAT_VERSION",
    "Manifest",
    "RowStats",
    "tokenizer_fingerprint",
    "manifest_path",
]

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


def manifest_path(directory: str | os.PathLike) -> str:
    """Where a prepared dataset directory keeps its manifest (written last: its presence, complete, marks a
    finished prep)."""
    return os.path.join(os.fspath(directory), MANIFEST_NAME)


def tokenizer_fingerprint(tokenizer) -> dict[str, Any]:
    """A short identity of a HF tokenizer: vocab size, special ids and the hash of its vocabulary and special
    tokens. Data whose fingerprint differs from the target tokenizer's means other ids."""
    return {
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "sha256": tokenizer_hash(tokenizer),  # the hash drafter checkpoints store too (longspec.fingerprint)
    }


@dataclass
class RowStats:
    """Counts of source rows: read = kept + sum(rejected.values())."""

    read: int = 0
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> count

    def reject(self, reason: str) -> None:
        self.read += 1
        self.rejected[reason] += 1

    def keep(self) -> None:
        self.read += 1
        self.kept += 1

    def to_dict(self) -> dict[str, Any]:
        return {"read": self.read, "kept": self.kept, "rejected": dict(sorted(self.rejected.items()))}

    def summary(self) -> str:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.rejected.items())) or "none"
        return f"rows read {self.read}, kept {self.kept}, rejected {sum(self.rejected.values())} ({reasons})"


@dataclass(kw_only=True)
class Manifest:
    """Everything a reader needs to know about a prepared dataset directory."""

    stage: str  # "stage1" | "stage2" | "stage3_sft": which prep tool wrote it
    source: str  # the source as given (HF id, file, directory)
    seq_len: int  # packed row length (stages 1-2) or the maximum row length (stage 3, rows vary)
    packed: bool  # True: every row is exactly seq_len tokens of EOS-separated documents
    has_loss_mask: bool  # True: a per-token mask says which tokens are trained on (SFT responses)
    token_dtype: str  # "uint16" | "uint32"
    tokenizer: dict[str, Any]  # tokenizer_fingerprint(...)
    # [{"name", "num_rows", "num_tokens", "sha256"}]: sha256 of the shard's bytes (older preps lack it)
    shards: list[dict[str, Any]] = field(default_factory=list)
    rows: dict[str, Any] = field(default_factory=dict)  # RowStats.to_dict()
    num_tokens: int = 0  # tokens stored over all shards
    extra: dict[str, Any] = field(default_factory=dict)  # stage-specific facts (tail tokens dropped, filters)
    complete: bool = False
    format_version: int = FORMAT_VERSION

    @property
    def num_rows(self) -> int:
        return sum(s["num_rows"] for s in self.shards)

    def save(self, directory: str | os.PathLike) -> None:
        write_json_atomic(manifest_path(directory), asdict(self))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Manifest:
        directory = os.fspath(directory)
        path = manifest_path(directory)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} not found: {directory!r} is not a prepared dataset (run `python -m data_prep.stage1|stage2|"
                "stage3_sft ... --out DIR` first)"
            )
        # A damaged manifest (a hand edit, a copy cut short, another tool's file) is one ValueError naming the
        # file, as a stale one is: a bare JSONDecodeError / TypeError named neither it nor the fix.
        with open(path, encoding="utf-8", errors="replace") as f:
            try:
                data = json.load(f)
            except ValueError as e:
                raise ValueError(f"{path} is not valid JSON ({e}); re-run the prep") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a prep manifest (a JSON {type(data).__name__}); re-run the prep")
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: format_version {data.get('format_version')} != {FORMAT_VERSION}; re-run the prep"
            )
        try:
            manifest = cls(**data)
        except TypeError as e:  # fields missing or unknown
            raise ValueError(f"{path} is not a prep manifest ({e}); re-run the prep") from None
        if not manifest.complete:
            raise ValueError(
                f"{directory!r} holds an interrupted prep (manifest not complete); re-run the same prep command "
                "to restart it"
            )
        return manifest
