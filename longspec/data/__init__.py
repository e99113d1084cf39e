"""Prepared training data: memory-mapped token shards + a JSON manifest (written by `data_prep`, read by the
trainer). See `shards.py` for the on-disk format."""

from longspec.data.manifest import Manifest, RowStats, tokenizer_fingerprint
from longspec.data.shards import ShardReader, ShardWriter

__all__ = ["Manifest", "RowStats", "ShardReader", "ShardWriter", "tokenizer_fingerprint"]
