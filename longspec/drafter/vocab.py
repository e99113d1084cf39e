"""The reduced draft vocabulary: the K target token ids the drafter's head scores.

The drafter shares the target's LM head, so a full-vocabulary draft step reads all V x Dm head weights; with a
draft vocabulary it reads only the K rows of the ids it may propose. Verification is unchanged: the target still
scores its full vocabulary, so a token outside the draft vocabulary is still produced by the target (as the bonus
token or a correction), only never proposed. Losslessness does not depend on which ids are chosen.

The ids are chosen from token counts of the drafter's own training data (the tokens it learns to predict), plus
every special and added token of the tokenizer (chat-template markers, end of turn), which a count over plain text
would miss. A `DraftVocab` is saved beside the drafter's weights (`DRAFT_VOCAB_NAME`, safetensors) and its
fingerprint goes into exports' metadata, so a drafter is never run with another map than it was trained with.

Shape legend: V target vocab, K draft vocab.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = ["DRAFT_VOCAB_NAME", "DraftVocab", "check_draft_vocab_size", "special_token_ids"]

DRAFT_VOCAB_NAME = "draft_vocab.safetensors"


def check_draft_vocab_size(size: int | None, vocab_size: int, field: str = "draft_vocab_size") -> None:
    """A draft vocabulary of `size` ids fits a target vocabulary of `vocab_size` (None: none asked): else one
    ValueError naming the setting `field`."""
    if size is not None and size > vocab_size:
        raise ValueError(
            f"{field}={size} is larger than the target's vocabulary of {vocab_size} ids: give at most {vocab_size} "
            "(or leave it unset to draft over the whole vocabulary)"
        )


def special_token_ids(tokenizer) -> list[int]:
    """Ids a draft vocabulary always keeps: the tokenizer's special tokens and every added token (a chat
    template's role and turn markers are added tokens), whatever their count in the training data."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids.update(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
    return sorted(i for i in ids if i is not None and i >= 0)


@dataclass(frozen=True, eq=False)
class DraftVocab:
    """`ids` [K] int64, strictly increasing target ids in [0, vocab_size): draft id k is target id ids[k]."""

    ids: torch.Tensor
    vocab_size: int

    def __post_init__(self):
        ids = self.ids
        if ids.dtype != torch.int64 or ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"draft vocabulary ids must be a non-empty 1-D int64 tensor, got {ids.dtype} "
                             f"{tuple(ids.shape)}")  # fmt: skip
        if not (ids[0] >= 0 and ids[-1] < self.vocab_size):
            raise ValueError(
                f"draft vocabulary ids must lie in [0, {self.vocab_size}), got {ids.min()}..{ids.max()}"
            )
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft vocabulary ids must be strictly increasing (sorted, no repeats)")

    @property
    def size(self) -> int:
        return self.ids.numel()

    @classmethod
    def from_counts(cls, counts: np.ndarray, size: int, *, keep: Iterable[int] = ()) -> DraftVocab:
        """The `size` ids: every id of `keep`, then the most frequent of `counts` [V] (ties: the lower id first,
        so the choice is deterministic)."""
        counts = np.asarray(counts)
        vocab_size = counts.shape[0]
        keep = sorted(set(int(i) for i in keep))
        if not 1 <= size <= vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, {vocab_size}] (the target's vocabulary), got {size}"
            )
        if keep and not (keep[0] >= 0 and keep[-1] < vocab_size):
            raise ValueError(
                f"special token ids {keep[0]}..{keep[-1]} fall outside the vocabulary of {vocab_size}"
            )
        if len(keep) > size:
            raise ValueError(
                f"draft_vocab_size {size} is smaller than the {len(keep)} special and added tokens it must keep"
            )
        # Kept ids rank first; the rest by count descending, then id ascending (a stable sort of -count).
        score = -counts.astype(np.float64)
        score[keep] = -np.inf
        order = np.argsort(score, kind="stable")[:size]
        return cls(torch.from_numpy(np.sort(order).astype(np.int64)), vocab_size)

    def head(self, lm_head: nn.Module) -> nn.Linear:
        """A frozen nn.Linear of `lm_head`'s rows for these ids, in its weight's dtype and on its device."""
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if hasattr(weight, "ds_id"):
            raise ValueError(
                "the LM head is a ZeRO-3 shard: a draft vocabulary's head rows are copied from a whole head only "
                "(training reads them itself)"
            )
        if weight.shape[0] != self.vocab_size:
            raise ValueError(
                f"this draft vocabulary ({self.size} ids) maps into a vocabulary of {self.vocab_size} ids, but the "
                f"LM head has {weight.shape[0]} rows: it was made for another target"
            )
        ids = self.ids.to(weight.device)
        head = nn.Linear(weight.shape[1], self.size, bias=bias is not None, device="meta")
        head.weight = nn.Parameter(weight.detach().index_select(0, ids), requires_grad=False)
        if bias is not None:
            head.bias = nn.Parameter(bias.detach().index_select(0, ids), requires_grad=False)
        return head

    def target_to_draft(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[V] int64: the draft id of each target id, -1 for ids outside the draft vocabulary."""
        table = torch.full((self.vocab_size,), -1, dtype=torch.int64)
        table[self.ids] = torch.arange(self.size, dtype=torch.int64)
        return table.to(device) if device is not None else table

    def coverage(self, counts: np.ndarray) -> float:
        """The fraction of the counted tokens that lie inside the draft vocabulary."""
        counts = np.asarray(counts, dtype=np.float64)
        total = counts.sum()
        return float(counts[self.ids.numpy()].sum() / total) if total > 0 else 1.0

    def fingerprint(self) -> str:
        """sha256 of (V, the ids as little-endian int64): equal exactly when the maps are equal."""
        digest = hashlib.sha256(f"{self.vocab_size}:".encode())
        digest.update(self.ids.numpy().astype("<i8").tobytes())
        return digest.hexdigest()

    def save(self, directory: str | os.PathLike) -> str:
        """Write `DRAFT_VOCAB_NAME` into `directory` (temp file + rename) and return its path."""
        from safetensors.torch import save_file

        path = os.path.join(os.fspath(directory), DRAFT_VOCAB_NAME)
        tmp = f"{path}.tmp-{os.getpid()}"
        metadata = {"vocab_size": str(self.vocab_size), "sha256": self.fingerprint()}
        try:
            save_file({"ids": self.ids.contiguous()}, tmp, metadata=metadata)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> DraftVocab | None:
        """The map saved in `directory`, None if there is none (a full-vocabulary drafter). A damaged file, or
        ids that do not match the fingerprint written with them, is one ValueError naming the file."""
        from safetensors import SafetensorError, safe_open

        path = os.path.join(os.fspath(directory), DRAFT_VOCAB_NAME)
        if not os.path.exists(path):
            return None
        try:
            with safe_open(path, framework="pt") as f:
                metadata = f.metadata() or {}
                ids = f.get_tensor("ids")
            vocab = cls(ids, int(metadata["vocab_size"]))
        except (SafetensorError, KeyError, ValueError, OSError) as e:
            raise ValueError(
                f"{path} is not a readable draft vocabulary ({e}); export the drafter again"
            ) from e
        if vocab.fingerprint() != metadata.get("sha256"):
            raise ValueError(f"{path}: its ids do not match the fingerprint written with them (damaged file)")
        return vocab
