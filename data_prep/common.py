"""Shared pieces of the prep tools: reading rows from any source, validating fields, packing, the output run.

Sources (one string, as the user typed it):
- a local file: ``*.jsonl`` / ``*.json`` (one JSON object per line; gzip'd as ``*.jsonl.gz``) or ``*.parquet``;
- a local directory: every text/code file below it (by extension) becomes one ``{"text", "path"}`` row;
- anything else is a Hugging Face dataset id, streamed with ``datasets`` (nothing is downloaded up front).
Every row is either kept or rejected with a reason (malformed_json, not_an_object, missing_field, wrong_type,
empty, non_text, too_long, too_short, ...); the counts go into the manifest and the summary line.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from longspec.data.manifest import Manifest, RowStats, tokenizer_fingerprint
from longspec.data.shards import ShardWriter, prepare_output_dir, token_dtype_for
from longspec.lifetime import RunLock, exit_if_orphaned

__all__ = [
    "TEXT_EXTENSIONS",
    "SourceRow",
    "iter_source",
    "check_source",
    "check_text",
    "check_messages",
    "load_tokenizer",
    "Packer",
    "PrepRun",
    "PREP_LOCK",
    "prep_lock",
    "prep_lock_path",
    "add_common_args",
]

log = logging.getLogger("data_prep")

# Files a directory source reads: prose and the common programming languages.
TEXT_EXTENSIONS = frozenset(
    ".txt .md .rst .tex .py .pyi .c .h .cc .cpp .hpp .cu .java .js .ts .go .rs .rb .php .sh .scala .kt .swift "
    ".lua .r .jl .hs .ml .sql .html .css .xml .yaml .yml .toml .json .cfg .ini".split()
)


@dataclass
class SourceRow:
    record: dict[str, Any] | None  # the parsed row, None when rejected
    reason: str | None = None  # why it was rejected


def _iter_jsonl(path: Path) -> Iterator[SourceRow]:
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue  # blank lines are layout, not rows
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                yield SourceRow(None, "malformed_json")
                continue
            yield SourceRow(record, None) if isinstance(record, dict) else SourceRow(None, "not_an_object")


def _iter_parquet(path: Path) -> Iterator[SourceRow]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield SourceRow(record, None)


def _iter_directory(root: Path, extensions: frozenset[str], max_bytes: int) -> Iterator[SourceRow]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".")
        )  # skip .git and friends, stable order
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.suffix.lower() not in extensions:
                continue
            if path.stat().st_size > max_bytes:
                yield SourceRow(None, "too_long")
                continue
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield SourceRow(None, "non_text")
                continue
            yield SourceRow({"text": text, "path": path.relative_to(root).as_posix()}, None)


def _iter_hf(dataset_id: str, split: str, name: str | None) -> Iterator[SourceRow]:
    import datasets

    try:
        stream = datasets.load_dataset(dataset_id, name=name, split=split, streaming=True)
    except (FileNotFoundError, ConnectionError) as e:  # unknown id, or the hub unreachable / offline mode
        raise FileNotFoundError(
            f"{dataset_id!r} is not a local file or directory, and the Hugging Face dataset could not be opened "
            f"({type(e).__name__}: {e}); check the path, or the network / HF_DATASETS_OFFLINE for hub ids"
        ) from e
    for record in stream:
        yield SourceRow(record, None) if isinstance(record, dict) else SourceRow(None, "not_an_object")


def iter_source(
    source: str,
    *,
    split: str = "train",
    hf_config: str | None = None,
    extensions: frozenset[str] = TEXT_EXTENSIONS,
    max_file_bytes: int = 64 << 20,
) -> Iterator[SourceRow]:
    """Rows of `source` (file, directory or HF dataset id), see the module docstring."""
    check_source(source)
    path = Path(source).expanduser()
    if path.is_dir():
        return _iter_directory(path, extensions, max_file_bytes)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json") or path.name.endswith((".jsonl.gz", ".json.gz")):
            return _iter_jsonl(path)
        return _iter_parquet(path)
    return _iter_hf(source, split, hf_config)


def check_source(source: str) -> None:
    """The checks of `iter_source` that need no reading: run before a prep creates its output, so a mistyped
    path fails before anything is written."""
    path = Path(source).expanduser()
    if path.is_dir():
        return
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix not in (".jsonl", ".json", ".parquet") and not path.name.endswith(
            (".jsonl.gz", ".json.gz")
        ):
            raise ValueError(
                f"{source}: unsupported file type {suffix!r}; use .jsonl (.jsonl.gz), .json or .parquet, "
                "or a directory"
            )
        return
    if source.startswith(("/", "./", "../", "~")) or source.endswith((".jsonl", ".json", ".parquet", ".gz")):
        raise FileNotFoundError(f"source {source!r} does not exist")


def check_text(value: Any, *, max_chars: int) -> tuple[str | None, str | None]:
    """-> (text, None) if `value` is usable text, else (None, reason)."""
    if value is None:
        return None, "missing_field"
    if not isinstance(value, str):
        return None, "wrong_type"
    if not value.strip():
        return None, "empty"
    if len(value) > max_chars:
        return None, "too_long"
    # NUL bytes and lone surrogates mean binary data decoded as text, not a document.
    if "\x00" in value:
        return None, "non_text"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None, "non_text"
    return value, None


def check_messages(value: Any, *, max_chars: int) -> tuple[list[dict[str, str]] | None, str | None]:
    """A chat `messages` list: [{"role": str, "content": str}, ...] -> (messages, None) or (None, reason)."""
    if not isinstance(value, list) or not value:
        return None, "wrong_type" if value else "empty"
    total = 0
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return None, "wrong_type"
        content, reason = check_text(message.get("content"), max_chars=max_chars)
        if reason is not None:
            return None, reason
        total += len(content)
    if total > max_chars:
        return None, "too_long"
    return [{"role": m["role"], "content": m["content"]} for m in value], None


def load_tokenizer(path: str, *, trust_remote_code: bool = False):
    """The target's tokenizer (local dir, hub id, .gguf file or pkg://PACKAGE/FILE.gguf). Prep must use the
    target's own tokenizer."""
    from longspec.cli import USER_ERRORS, UserError, one_line
    from longspec.target_source import load_tokenizer as load_target_tokenizer

    try:
        tokenizer = load_target_tokenizer(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if isinstance(e, USER_ERRORS) and (not isinstance(e, ValueError) or str(path) in str(e)):
            raise  # already names the tokenizer (a missing file, a bad GGUF)
        # Any other failure of transformers' (which longspec.target_source does not name itself: it names an
        # uncached hub id and a directory without tokenizer files) is one line naming the tokenizer too.
        reason = one_line(e).split(". ")[0]
        raise UserError(
            f"cannot load the tokenizer {path!r} ({reason}); pass the target's tokenizer directory, its .gguf file, "
            "or a hub id with network access"
        ) from e
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {path!r} has no EOS token: packed documents need one as a separator")
    return tokenizer


class Packer:
    """Concatenates EOS-terminated documents and cuts them into rows of exactly `seq_len` tokens.

    A document longer than a row continues into the next row (standard pretraining packing); the partial last
    row is dropped at the end and counted."""

    def __init__(self, seq_len: int, eos_id: int):
        self.seq_len = seq_len
        self.eos_id = eos_id
        self._parts: list[np.ndarray] = []
        self._buffered = 0

    def add(self, ids: list[int]) -> Iterator[np.ndarray]:
        if not ids or ids[-1] != self.eos_id:
            ids = [*ids, self.eos_id]
        self._parts.append(np.asarray(ids, dtype=np.int64))
        self._buffered += len(ids)
        if self._buffered < self.seq_len:
            return
        flat = np.concatenate(self._parts)
        num_rows = flat.size // self.seq_len
        for r in range(num_rows):
            yield flat[r * self.seq_len : (r + 1) * self.seq_len]
        rest = flat[num_rows * self.seq_len :]
        self._parts, self._buffered = ([rest] if rest.size else []), rest.size

    @property
    def tail_tokens(self) -> int:
        """Tokens left over (fewer than one row): dropped when the prep ends."""
        return self._buffered


def batched(rows: Iterable, size: int) -> Iterator[list]:
    """`rows` in lists of `size`. Before each batch a prep checks that the process that started it still runs
    (the fallback of the parent-death signal, longspec.lifetime): a pipeline's orphan stops at its next batch."""
    batch = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            exit_if_orphaned()
            yield batch
            batch = []
    if batch:
        exit_if_orphaned()
        yield batch


PREP_LOCK = "prep.lock"  # in a prep's --out while it writes there (longspec.lifetime)


def prep_lock_path(out: str, *, file: bool = False) -> str:
    """Where a data prep's lock on its --out lies: `<out>/prep.lock`, or `<out>.lock` beside an output file."""
    return f"{os.path.abspath(out)}.lock" if file else os.path.join(out, PREP_LOCK)


def prep_lock(out: str, *, file: bool = False) -> RunLock:
    """The lock a data prep holds on its --out (prep_lock_path) while it writes there."""
    path = prep_lock_path(out, file=file)
    if file and not os.path.isdir(os.path.dirname(path)):
        raise FileNotFoundError(f"--out {out!r}: the directory {os.path.dirname(path)!r} does not exist")
    return RunLock(
        os.path.dirname(path),
        name=os.path.basename(path),
        user="data prep",
        dir_option="--out",
        force_option=None,
    )


class PrepRun:
    """One prep run: output directory, shard writer, row statistics, progress bar and the final manifest.

    It holds the --out's lock from before anything there is removed until the manifest is written (finish); a run
    that fails releases it when the run is collected, or at the interpreter's exit."""

    def __init__(
        self,
        *,
        out: str,
        stage: str,
        source: str,
        tokenizer,
        seq_len: int,
        packed: bool,
        has_loss_mask: bool,
        overwrite: bool,
        shard_tokens: int,
        progress: bool = True,
    ):
        lock = prep_lock(out)
        self._release = weakref.finalize(self, lock.release)
        try:
            self.out = prepare_output_dir(out, overwrite=overwrite, lock=lock.acquire)
        except BaseException:
            self._release()
            raise
        self.stage, self.source, self.seq_len, self.packed = stage, source, seq_len, packed
        self.tokenizer = tokenizer
        self.stats = RowStats()
        self.writer = ShardWriter(
            self.out,
            token_dtype=token_dtype_for(len(tokenizer)),
            has_loss_mask=has_loss_mask,
            shard_tokens=shard_tokens,
        )
        self.bar = tqdm(desc=f"{stage} {Path(source).name or source}", unit=" rows", disable=not progress)

    def reject(self, reason: str) -> None:
        self.stats.reject(reason)
        self.bar.update(1)

    def keep(self) -> None:
        self.stats.keep()
        self.bar.update(1)
        if self.stats.kept % 256 == 0:
            self.bar.set_postfix(
                kept=self.stats.kept, rows_out=self.writer.num_rows, tokens=self.writer.num_tokens
            )

    def finish(self, **extra: Any) -> Manifest:
        self.bar.close()
        if self.writer.num_rows == 0:
            what = (
                "no valid rows"
                if self.stats.kept == 0
                else "valid rows but not enough tokens for one sequence"
            )
            raise ValueError(f"source {self.source!r} produced {what}: {self.stats.summary()}")
        manifest = Manifest(
            stage=self.stage,
            source=self.source,
            seq_len=self.seq_len,
            packed=self.packed,
            has_loss_mask=self.writer.has_loss_mask,
            token_dtype=self.writer.token_dtype.name,
            tokenizer=tokenizer_fingerprint(self.tokenizer),
            rows=self.stats.to_dict(),
            extra=extra,
        )
        manifest = self.writer.finish(manifest)
        self._release()
        log.info(
            "%s: %s; wrote %d rows, %d tokens in %d shard(s) to %s",
            self.stage,
            self.stats.summary(),
            manifest.num_rows,
            manifest.num_tokens,
            len(manifest.shards),
            self.out,
        )
        print(
            f"{self.stats.summary()}; {manifest.num_rows} rows / {manifest.num_tokens} tokens -> {self.out}"
        )
        return manifest


def add_common_args(parser, *, default_source: str | None = None, repeat_source: bool = False) -> None:
    """Arguments every prep tool takes. `repeat_source`: --source may be given several times (a mix)."""
    help_text = "local .jsonl/.json/.parquet file, directory, or HF dataset id"
    if repeat_source:
        parser.add_argument("--source", action="append", required=True, help=help_text + " (repeatable)")
    else:
        parser.add_argument(
            "--source",
            required=default_source is None,
            default=default_source,
            help=help_text + (f" (default: {default_source})" if default_source else ""),
        )
    parser.add_argument(
        "--tokenizer", required=True, help="the target's tokenizer (its model dir, hub id or .gguf file)"
    )
    parser.add_argument("--out", required=True, help="output directory (shards + manifest.json)")
    parser.add_argument("--split", default="train", help="HF dataset split")
    parser.add_argument("--hf-config", default=None, help="HF dataset configuration name")
    parser.add_argument("--max-rows", type=int, default=None, help="stop after reading this many source rows")
    parser.add_argument("--max-chars", type=int, default=4_000_000, help="reject rows with more characters")
    parser.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard file")
    parser.add_argument("--overwrite", action="store_true", help="redo a finished prep in --out")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--no-progress", action="store_true")


def common_kwargs(args) -> dict:
    """The prepare_* keyword arguments that come from `add_common_args` (source/split/hf_config excepted:
    their meaning differs per tool)."""
    return dict(
        tokenizer=load_tokenizer(args.tokenizer, trust_remote_code=args.trust_remote_code),
        out=args.out,
        max_rows=args.max_rows,
        max_chars=args.max_chars,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )


def limit(rows: Iterator[SourceRow], max_rows: int | None) -> Iterator[SourceRow]:
    for i, row in enumerate(rows):
        if max_rows is not None and i >= max_rows:
            return
        yield row
