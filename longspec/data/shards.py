"""Memory-mapped token shards.

On-disk format of one prepared dataset directory (format_version 1):
    manifest.json                   the Manifest (written last; `complete: true` once the prep finished)
    shard_00000.tokens.bin          all rows' token ids back to back, uint16 (vocab <= 65536) or uint32
    shard_00000.offsets.bin         int64 [num_rows + 1]: row r is tokens[offsets[r]:offsets[r + 1]]
    shard_00000.mask.bin            uint8 per token, only when the manifest says has_loss_mask: 1 = train on it
    shard_00001.*                   ...
Each shard file is written under a temporary name and renamed into place, so a file with a final name is always
complete; the manifest, renamed last, lists the shards. Readers memory-map the files (no copy into RAM).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
from collections.abc import Callable, Sequence

import numpy as np

from longspec.atomic import write_bytes_atomic
from longspec.data.manifest import Manifest, manifest_path
from longspec.ownership import check_output_dir, claim_output_dir

__all__ = ["ShardWriter", "ShardReader", "token_dtype_for", "prepare_output_dir"]

DEFAULT_SHARD_TOKENS = 1 << 27  # 128M tokens: 256 MB at uint16, a few hundred thousand 1K rows


def token_dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "uint32"


def _write_array_atomic(path: str, array: np.ndarray) -> None:
    # The bytes through f.write, not ndarray.tofile: tofile reports a full disk as "N requested and M written",
    # without the errno.
    write_bytes_atomic(path, memoryview(np.ascontiguousarray(array)).cast("B"))


# What a prep writes in its directory: only these are removed when a prep restarts there (and only in a
# directory marked as a data output, longspec.ownership).
_PREP_FILE = re.compile(r"^shard_\d{5}\.(tokens|offsets|mask)\.bin(\.tmp-\d+)?$|^manifest\.json(\.tmp-\d+)?$")


def prepare_output_dir(
    directory: str | os.PathLike, *, overwrite: bool, lock: Callable[[], None] | None = None
) -> str:
    """Make `directory` ready for a fresh prep.

    A directory this project did not write is refused (`overwrite` or not); a finished prep (complete manifest) is
    kept unless `overwrite`; leftovers of an interrupted prep (its shards, temp files, manifest) are removed so the
    prep restarts from the beginning. Nothing else in the directory is touched. `lock` is called once the
    directory is claimed, before anything in it is removed: a data prep takes its lock there (a second prep on the
    same directory must not remove the first's shards while it writes them)."""
    directory = os.fspath(directory)
    manifest = manifest_path(directory)
    check_output_dir(directory, "data", what="--out")
    if os.path.isfile(manifest) and not overwrite:
        try:
            Manifest.load(directory)
        except ValueError:
            pass  # interrupted or stale: restart below
        else:
            raise FileExistsError(f"{directory!r} already holds a finished prep; pass --overwrite to redo it")
    claim_output_dir(directory, "data", what="--out")
    if lock is not None:
        lock()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if _PREP_FILE.match(name) and (os.path.islink(path) or os.path.isfile(path)):
            os.remove(path)  # a symlink is removed itself, never what it points to
    return directory


class ShardWriter:
    """Buffers rows in memory and writes a shard every `shard_tokens` tokens (temp file + rename)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        token_dtype: str,
        has_loss_mask: bool,
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
    ):
        if token_dtype not in ("uint16", "uint32"):
            raise ValueError(f"token_dtype must be uint16 or uint32, got {token_dtype!r}")
        self.directory = os.fspath(directory)
        self.token_dtype = np.dtype(token_dtype)
        self.has_loss_mask = has_loss_mask
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self._rows: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._buffered = 0

    @property
    def num_tokens(self) -> int:
        return sum(s["num_tokens"] for s in self.shards) + self._buffered

    @property
    def num_rows(self) -> int:
        return sum(s["num_rows"] for s in self.shards) + len(self._rows)

    def add(self, tokens: Sequence[int] | np.ndarray, mask: Sequence[int] | np.ndarray | None = None) -> None:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError("a row must be a non-empty 1-D sequence of token ids")
        if int(tokens.max()) > np.iinfo(self.token_dtype).max or int(tokens.min()) < 0:
            raise ValueError(f"token id out of range for {self.token_dtype}")
        self._rows.append(tokens.astype(self.token_dtype, copy=False))
        if self.has_loss_mask:
            if mask is None or len(mask) != tokens.size:
                raise ValueError("this writer stores a loss mask: pass one 0/1 value per token")
            self._masks.append(np.asarray(mask, dtype=np.uint8))
        elif mask is not None:
            raise ValueError("this writer was created with has_loss_mask=False")
        self._buffered += tokens.size
        if self._buffered >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        name = f"shard_{len(self.shards):05d}"
        base = os.path.join(self.directory, name)
        lengths = np.fromiter((r.size for r in self._rows), dtype=np.int64, count=len(self._rows))
        offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)])
        # The shard's bytes, hashed in memory as they are written: the manifest then changes with the data, and its
        # hash is what a training resume compares (longspec.train.inputs).
        digest = hashlib.sha256()
        arrays = [("tokens", np.concatenate(self._rows))]
        if self.has_loss_mask:
            arrays.append(("mask", np.concatenate(self._masks)))
        arrays.append(("offsets", offsets))  # last: a shard is listed only after all its files are in place
        for kind, array in arrays:
            digest.update(array.tobytes())
            _write_array_atomic(f"{base}.{kind}.bin", array)
        self.shards.append(
            {
                "name": name,
                "num_rows": len(self._rows),
                "num_tokens": int(offsets[-1]),
                "sha256": digest.hexdigest(),
            }
        )
        self._rows, self._masks, self._buffered = [], [], 0

    def finish(self, manifest: Manifest) -> Manifest:
        """Flush the last shard and write the manifest (complete) — the commit point of the prep."""
        self.flush()
        manifest.shards = list(self.shards)
        manifest.num_tokens = sum(s["num_tokens"] for s in self.shards)
        manifest.token_dtype = self.token_dtype.name
        manifest.has_loss_mask = self.has_loss_mask
        manifest.complete = True
        manifest.save(self.directory)
        return manifest


class ShardReader:
    """Random access to the rows of a prepared dataset directory, memory-mapped."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        self.manifest = Manifest.load(self.directory)
        if not self.manifest.shards:
            raise ValueError(f"{self.directory!r}: the manifest lists no shards")
        dtype = np.dtype(self.manifest.token_dtype)
        self._tokens, self._offsets, self._masks = [], [], []
        for shard in self.manifest.shards:
            base = os.path.join(self.directory, shard["name"])
            tokens = self._map(f"{base}.tokens.bin", dtype, shard["num_tokens"])
            offsets = self._map(f"{base}.offsets.bin", np.dtype(np.int64), shard["num_rows"] + 1)
            self._tokens.append(tokens)
            self._offsets.append(offsets)
            if self.manifest.has_loss_mask:
                self._masks.append(self._map(f"{base}.mask.bin", np.dtype(np.uint8), shard["num_tokens"]))
        self._starts = np.cumsum([0] + [s["num_rows"] for s in self.manifest.shards]).tolist()

    def _map(self, path: str, dtype: np.dtype, count: int) -> np.ndarray:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"shard file {path} is missing: the prepared data is incomplete, re-run the prep"
            )
        expected = count * dtype.itemsize
        if os.path.getsize(path) != expected:
            raise ValueError(
                f"{path} has {os.path.getsize(path)} bytes, the manifest implies {expected}: corrupt data"
            )
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,))

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def seq_len(self) -> int:
        return self.manifest.seq_len

    def token_arrays(self):
        """Yield (tokens, loss mask or None) of each shard whole, memory-mapped (no copy)."""
        for i, tokens in enumerate(self._tokens):
            yield tokens, (self._masks[i] if self._masks else None)

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        """-> (tokens [L] int64, loss mask [L] bool or None)."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range [0, {len(self)})")
        shard = bisect.bisect_right(self._starts, index) - 1
        local = index - self._starts[shard]
        start, end = self._offsets[shard][local], self._offsets[shard][local + 1]
        tokens = np.asarray(self._tokens[shard][start:end], dtype=np.int64)
        mask = np.asarray(self._masks[shard][start:end], dtype=bool) if self._masks else None
        return tokens, mask
