"""Helpers of the fault-injection suite: every case checks the exit status, the one-line message, and that nothing
outside the output it was allowed to write changed (checksums of the tree before and after).

Imported by the test files as `from fault_helpers import ...` (pytest puts this directory on sys.path)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def tree_checksums(root: str | os.PathLike) -> dict[str, str]:
    """relative path -> sha256 of every file below `root`, and "dir" for every directory (so a leftover empty
    temp directory shows as a change too). Symlinks are recorded by target, never followed."""
    root = Path(root)
    sums: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            sums[os.path.relpath(os.path.join(dirpath, name), root)] = "dir"
        for name in filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                sums[rel] = "link:" + os.readlink(path)
                continue
            with open(path, "rb") as f:
                sums[rel] = hashlib.sha256(f.read()).hexdigest()
    return sums


def changed_paths(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}


def assert_only_changed(root: str | os.PathLike, before: dict[str, str], allowed: Iterable[str] = ()) -> None:
    """Everything below `root` is as in `before`, except paths at or below one of `allowed` (relative to root)."""
    allowed = [a.rstrip("/") for a in allowed]
    changed = {
        p
        for p in changed_paths(before, tree_checksums(root))
        if not any(p == a or p.startswith(a + os.sep) for a in allowed)
    }
    assert not changed, f"files outside the output changed: {sorted(changed)}"


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_module(module: str, *args: str, env: dict | None = None, timeout: float = 120) -> CliResult:
    """`python -m module args...` in a subprocess (the real entry point, exit status and stderr included)."""
    # HYDRA_FULL_ERROR from the caller's shell would turn the one-line errors under test into tracebacks.
    full_env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    full_env.update({"PYTHONPATH": str(REPO_ROOT), **(env or {})})
    proc = subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO_ROOT,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def assert_one_line_error(stderr: str, pattern: str, *, exclusive: bool = True) -> str:
    """stderr holds exactly one `error: ...` line matching `pattern` (a regex searched in it) and no traceback.
    `exclusive`: that line is all of stderr (False where the tool logs progress to stderr before failing)."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, f"expected one 'error: ' line, got stderr:\n{stderr}"
    if exclusive:
        assert lines == errors, f"expected stderr to be the error line alone, got:\n{stderr}"
    assert re.search(pattern, errors[0]), f"{pattern!r} not in {errors[0]!r}"
    return errors[0]


def run_in_process(main, argv: list[str], capsys) -> tuple[int, str]:
    """A CLI's `main(argv)` in this process (no interpreter start-up): -> (exit status, stderr). `main` is the
    entry point itself (console script and `python -m` alike), so a traceback escaping it fails the test."""
    capsys.readouterr()
    status = main(argv)
    return status, capsys.readouterr().err


def tiny_train_world(tmp: Path) -> Path:
    """What the training fault cases train on: a tiny target `tmp/tiny_llama` and stage-1 data of 64-token rows
    `tmp/d1` (120 short documents of code words, seeded). Returns `tmp`."""
    from data_prep.common import load_tokenizer
    from data_prep.stage1 import prepare_stage1
    from longspec.testing import save_tiny_target

    words = "def class return import self value list dict for while if else print data model token".split()
    target = save_tiny_target("llama", tmp / "tiny_llama")
    rng = random.Random(0)
    rows = (" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for _ in range(120))
    (tmp / "short.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    prepare_stage1(
        source=str(tmp / "short.jsonl"),
        tokenizer=load_tokenizer(target),
        out=str(tmp / "d1"),
        seq_len=64,
        progress=False,
    )
    return tmp


@contextlib.contextmanager
def read_only(monkeypatch, folder: str | os.PathLike):
    """Inside the block `folder` is read-only: chmod 0o555 where that stops this user (writes fail with EACCES),
    else (root, whom chmod does not stop) as `deny_writes` with EROFS. Yields the errno the writes fail with."""
    folder = os.path.abspath(folder)
    if os.geteuid() == 0:
        with deny_writes(monkeypatch, folder, errno.EROFS):
            yield errno.EROFS
        return
    mode = os.stat(folder).st_mode
    os.chmod(folder, 0o555)
    try:
        yield errno.EACCES
    finally:
        os.chmod(folder, mode)


@contextlib.contextmanager
def deny_writes(monkeypatch, folder: str | os.PathLike, error: int):
    """Inside the block, `open` for writing, `os.mkdir` and `os.makedirs` below `folder` raise OSError(`error`)
    naming the path, as the kernel does on a full disk (ENOSPC) or a read-only file system (EROFS)."""
    import builtins

    folder = os.path.abspath(folder)

    def below(path) -> bool:
        path = os.path.abspath(os.fspath(path))
        return path == folder or path.startswith(folder + os.sep)

    real_open, real_mkdir, real_makedirs = builtins.open, os.mkdir, os.makedirs

    def deny(path):
        raise OSError(error, os.strerror(error), os.fspath(path))

    def fake_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and below(file) and any(c in mode for c in "wax+"):
            deny(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if below(path):
            deny(path)
        return real_mkdir(path, *args, **kwargs)

    def fake_makedirs(path, *args, **kwargs):
        if below(path) and not os.path.isdir(path):
            deny(path)
        return real_makedirs(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", fake_open)
        patch.setattr(os, "mkdir", fake_mkdir)
        patch.setattr(os, "makedirs", fake_makedirs)
        yield


class FullDiskFile:
    """A file opened for writing on a full disk: its first write raises ENOSPC without a file name, as a real
    write(2) does (Python's OSError of a failed write names no file)."""

    def __init__(self, path, mode="wb", *args, **kwargs):
        self._file = open(path, mode, *args, **kwargs)

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()
