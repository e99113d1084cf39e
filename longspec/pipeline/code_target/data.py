"""The tokenizer and the token cache: each corpus split as one flat uint16 stream, cut into packed windows."""

# Shape legend: B sequences per step, T tokens per sequence (seq_len).

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch


def load_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    if not (Path(path) / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {path}: run `python -m data_prep.train_tokenizer` first"
        )
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def tokenizer_digest(tokenizer) -> str:
    """Identity of a tokenizer's vocabulary, stored beside the token cache to catch stale caches."""
    # The sorted vocabulary, not the serialized tokenizer.json: its layout changes between `tokenizers` versions.
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode("utf-8")).hexdigest()[:16]


def tokenize_jsonl(jsonl: Path, tokenizer, *, batch_files: int = 64) -> np.ndarray:
    """``<s> ids </s>`` per ``text`` row, concatenated into one uint16 stream (vocabularies up to 65536)."""
    if len(tokenizer) > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"vocabulary of {len(tokenizer)} does not fit the uint16 token cache")
    with open(jsonl, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    eos = tokenizer.eos_token_id
    chunks = []
    for i in range(0, len(texts), batch_files):
        # The backend tokenizer (not __call__) so long files raise no model_max_length warning; the post-processor
        # still prepends <s>, as tokenizer(text) does at inference.
        for enc in tokenizer.backend_tokenizer.encode_batch(texts[i : i + batch_files]):
            chunks.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)


def build_token_cache(corpus: Path | None, tokenizer, tokens_dir: Path) -> dict:
    """Tokenize ``corpus/{train,heldout}.jsonl`` into ``tokens_dir/{train,heldout}.npy`` + ``meta.json``."""
    if corpus is None or not (corpus / "train.jsonl").is_file():
        raise FileNotFoundError(
            f"no token cache in {tokens_dir} and no corpus to build it from ({corpus}/train.jsonl): "
            "run `python -m data_prep.stdlib_corpus --out DIR` and pass --corpus DIR"
        )
    tokens_dir.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer_digest": tokenizer_digest(tokenizer), "vocab_size": len(tokenizer), "tokens": {}}
    for split in ("train", "heldout"):
        ids = tokenize_jsonl(corpus / f"{split}.jsonl", tokenizer)
        np.save(tokens_dir / f"{split}.npy", ids)
        meta["tokens"][split] = int(ids.size)
    manifest = corpus / "manifest.json"
    if manifest.is_file():
        meta["corpus_python_version"] = json.loads(manifest.read_text())["python_version"]
    (tokens_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_token_cache(
    tokens_dir: Path, tokenizer, corpus: Path | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The train / held-out uint16 streams, built first if missing; a cache from another tokenizer is an error."""
    meta_path = tokens_dir / "meta.json"
    if not meta_path.is_file():
        build_token_cache(corpus, tokenizer, tokens_dir)
    meta = json.loads(meta_path.read_text())
    if meta["tokenizer_digest"] != tokenizer_digest(tokenizer):
        raise ValueError(
            f"token cache {tokens_dir} was built with another tokenizer: delete it or pass another dir"
        )
    return np.load(tokens_dir / "train.npy"), np.load(tokens_dir / "heldout.npy")


class PackedStream:
    """Packed ``T+1``-token windows over one token stream, shuffled per epoch with a random phase.

    The phase (0..T-1) moves window boundaries between epochs so every token is, over time, seen with long context.
    """

    def __init__(self, ids: torch.Tensor, seq_len: int, batch_size: int, generator: torch.Generator):
        if ids.numel() < seq_len + 1 + seq_len:
            raise ValueError(f"train stream of {ids.numel()} tokens is too short for seq_len {seq_len}")
        self.ids, self.seq_len, self.batch_size, self.gen = ids, seq_len, batch_size, generator
        self.offsets = torch.arange(seq_len + 1, device=ids.device)
        self.epoch, self._order, self._pos = 0, None, 0

    @property
    def windows_per_epoch(self) -> int:
        return (self.ids.numel() - 1 - self.seq_len) // self.seq_len  # phase may take up to T-1 tokens

    def _new_epoch(self) -> None:
        phase = int(torch.randint(self.seq_len, (1,), generator=self.gen))
        starts = phase + self.seq_len * torch.arange(self.windows_per_epoch)
        self._order = starts[torch.randperm(starts.numel(), generator=self.gen)].to(self.ids.device)
        self._pos = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [B,T], labels [B,T])`` as int64 on the stream's device."""
        if self._order is None or self._pos + self.batch_size > self._order.numel():
            if self._order is not None:
                self.epoch += 1
            self._new_epoch()
        starts = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        window = self.ids[starts[:, None] + self.offsets]  # [B, T+1]
        return window[:, :-1], window[:, 1:]
