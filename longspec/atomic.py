"""Atomic file writes: a temp file next to the target, fsync, rename. Readers (and a resumed run after a crash,
even SIGKILL) see the old file or the new one, never a half-written one.

Cross-cutting (tests/test_layers.py): data manifests, training checkpoints, eval results and reports all use it,
and it imports nothing of longspec."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["umask_file_mode", "write_bytes_atomic", "write_text_atomic", "write_json_atomic"]


def write_bytes_atomic(path: str | os.PathLike, data: bytes | memoryview) -> None:
    """Write `data` to `path` via a temp file + fsync + rename: readers see the old file or the new one, never half.
    A missing parent directory is created (an output folder such as a benchmark's $OUT need not exist yet); a
    failure removes the temp file, and an OSError names `path` when the failed write named no file."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and e.filename is None:  # a failed write names no file: name the target
            raise OSError(e.errno, e.strerror, path) from None
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically (see write_bytes_atomic)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON to `path` atomically (see write_text_atomic)."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def umask_file_mode(path: str | os.PathLike) -> None:
    """Give `path` the mode a plain open() gives a new file (0o666 less the umask). safetensors 0.8 writes its
    files 0o600 whatever the umask, which would hide an export or checkpoint from the rest of a shared cluster."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
