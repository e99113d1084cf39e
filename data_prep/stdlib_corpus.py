"""Build a code corpus from the local Python standard library (issue 5).

    python -m data_prep.stdlib_corpus --out DIR [--root PATH] [--heldout-frac 0.05]

Writes into DIR:
- ``train.jsonl`` / ``heldout.jsonl``: rows ``{"text": ..., "path": ...}`` (the ``text`` schema the stage-1 prep reads);
- ``heldout_lcc.jsonl``: LongBench LCC-schema code-completion rows cut from long held-out files;
- ``manifest.json``: files read / kept / rejected (with reasons), bytes and files per split, Python version.

The split is a stable hash of the file's path relative to the stdlib root, so the same modules are held out on every
machine and Python version (the shipped target was trained on one version's train split; a fresh machine with another
version still evaluates on files the target never saw, as long as their relative paths were held out there too).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import re
import sys
import sysconfig
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from longspec.cli import ArgumentParser, run_cli
from longspec.ownership import claim_output_dir

# Directories never walked: installed third-party packages and bytecode caches are not the stdlib.
SKIP_DIR_NAMES = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Test fixture folders ("tokenizedata", "test_email/data", "lib2to3/tests/data", ...) hold deliberately broken,
# Python-2 or oddly encoded files: junk for a code model. Matched on a path component below a test folder.
_TEST_DIR = re.compile(r"^(test|tests|idle_test)$")
_DATA_DIR = re.compile(r"(data\d*|encoded_modules|badsyntax.*)$")


@dataclass(kw_only=True)
class CorpusConfig:
    """Options of the stdlib corpus builder."""

    out: Path
    """Output directory (created)."""
    root: Path | None = None
    """Tree to walk; default: this interpreter's stdlib (``sysconfig.get_paths()['stdlib']``)."""
    heldout_frac: float = 0.05
    """Fraction of files (by path hash) held out for evaluation."""
    max_file_bytes: int = 400_000
    """Larger files are rejected: in the stdlib they are generated data tables (pydoc_data/topics.py), not code."""
    check_syntax: bool = True
    """Reject files this interpreter cannot parse (Python 2 leftovers, deliberately broken test inputs)."""
    lcc_min_chars: int = 6_000
    """A held-out file makes an LCC row only if it has at least this many characters."""
    lcc_max_context_chars: int = 48_000
    """Upper bound on an LCC context (~12K tokens); the eval left-truncates further by tokens."""
    lcc_answer_lines: int = 1
    """Lines in an LCC answer (LongBench LCC uses the single next line)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.heldout_frac < 1.0:
            raise ValueError(f"heldout_frac must be in (0, 1), got {self.heldout_frac}")
        if self.max_file_bytes <= 0 or self.lcc_min_chars <= 0 or self.lcc_max_context_chars <= 0:
            raise ValueError("max_file_bytes, lcc_min_chars and lcc_max_context_chars must be positive")
        if self.lcc_answer_lines < 1:
            raise ValueError(f"lcc_answer_lines must be >= 1, got {self.lcc_answer_lines}")


@dataclass
class CorpusStats:
    files_read: int = 0
    kept: Counter = field(default_factory=Counter)  # split -> files
    bytes: Counter = field(default_factory=Counter)  # split -> UTF-8 bytes
    rejected: Counter = field(default_factory=Counter)  # reason -> files
    rejected_paths: dict = field(default_factory=dict)  # relpath -> reason


def default_stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def path_fraction(relpath: str, salt: str = "") -> float:
    """Uniform value in [0, 1) from a SHA-256 of the POSIX relative path: stable across machines and versions."""
    digest = hashlib.sha256((salt + relpath).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(relpath: str, heldout_frac: float) -> str:
    return "heldout" if path_fraction(relpath) < heldout_frac else "train"


def iter_python_files(root: Path):
    """Yield ``.py`` files under ``root`` in sorted order, never descending into ``SKIP_DIR_NAMES``."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIR_NAMES)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def in_test_data_dir(relpath: str) -> bool:
    parts = relpath.split("/")[:-1]
    for i, part in enumerate(parts):
        if _TEST_DIR.match(part) and any(_DATA_DIR.search(p) for p in parts[i + 1 :]):
            return True
    return False


def read_source(path: Path, relpath: str, cfg: CorpusConfig) -> tuple[str | None, str | None]:
    """Return ``(text, None)`` for a usable file or ``(None, reason)``."""
    if in_test_data_dir(relpath):
        return None, "test_data_dir"
    return check_python_bytes(
        path.read_bytes(), relpath, max_bytes=cfg.max_file_bytes, check_syntax=cfg.check_syntax
    )


def check_python_bytes(
    raw: bytes, relpath: str, *, max_bytes: int, check_syntax: bool = True
) -> tuple[str | None, str | None]:
    """A Python file's bytes -> ``(text, None)`` if usable, else ``(None, reason)`` (shared with the registry
    corpus, whose files come out of archives rather than off the disk)."""
    if not raw.strip():
        return None, "empty"
    if len(raw) > max_bytes:
        return None, "too_large"
    if b"\x00" in raw:
        return None, "binary"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not_utf8"
    text = text.removeprefix("\ufeff")  # a BOM is an encoding marker, not code
    if check_syntax:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escape sequences in old code are not our concern
                ast.parse(text, filename=relpath)
        except (SyntaxError, ValueError):
            return None, "syntax_error"
    return text, None


def lcc_row(relpath: str, text: str, cfg: CorpusConfig) -> dict | None:
    """One LongBench-LCC row: a long prefix cut at a line boundary, the answer the next non-blank line(s).

    The cut is at a hash-chosen point between 60% and 90% of the file's lines (deterministic), pulled back so the
    context fits ``lcc_max_context_chars``.
    """
    if len(text) < cfg.lcc_min_chars:
        return None
    lines = text.splitlines(keepends=True)
    cut = int(len(lines) * (0.6 + 0.3 * path_fraction(relpath, salt="lcc-cut")))
    prefix_chars = [0]
    for line in lines:
        prefix_chars.append(prefix_chars[-1] + len(line))
    while cut > 0 and prefix_chars[cut] > cfg.lcc_max_context_chars:
        cut -= 1
    # Blank lines go into the context; the answer starts at the next line with code on it.
    while cut < len(lines) and not lines[cut].strip():
        cut += 1
    answer = [ln.rstrip("\r\n") for ln in lines[cut:] if ln.strip()][: cfg.lcc_answer_lines]
    context = "".join(lines[:cut])
    if len(answer) < cfg.lcc_answer_lines or len(context) < cfg.lcc_min_chars // 2:
        return None
    return {
        "_id": hashlib.sha256(f"lcc:{relpath}".encode()).hexdigest()[:32],
        "input": "",
        "context": context,
        "answers": ["\n".join(answer)],
        "length": len(context.split()),  # LongBench counts whitespace-separated words
        "all_classes": None,
        "language": "python",
        "dataset": "lcc",
        "path": relpath,
    }


def build_corpus(cfg: CorpusConfig, *, progress: bool = True) -> dict:
    """Walk the tree, write the jsonl splits, the LCC rows and the manifest; return the manifest."""
    root = (cfg.root or default_stdlib_root()).resolve()
    if not root.is_dir():
        raise FileNotFoundError(
            f"corpus root {root} is not a directory (pass --root PATH to a Python source tree)"
        )
    files = list(iter_python_files(root))
    if not files:  # an empty corpus wrote exit 0 and failed two steps later, at the first prep
        raise ValueError(f"corpus root {root} holds no .py file (pass --root PATH to a Python source tree)")
    claim_output_dir(cfg.out, "corpus", what="--out")
    stats = CorpusStats()
    num_lcc = 0
    with (
        open(cfg.out / "train.jsonl", "w", encoding="utf-8") as f_train,
        open(cfg.out / "heldout.jsonl", "w", encoding="utf-8") as f_heldout,
        open(cfg.out / "heldout_lcc.jsonl", "w", encoding="utf-8") as f_lcc,
    ):
        for path in tqdm(files, desc="stdlib corpus", unit="file", disable=not progress):
            relpath = path.relative_to(root).as_posix()
            stats.files_read += 1
            text, reason = read_source(path, relpath, cfg)
            if text is None:
                stats.rejected[reason] += 1
                stats.rejected_paths[relpath] = reason
                continue
            split = split_of(relpath, cfg.heldout_frac)
            stats.kept[split] += 1
            stats.bytes[split] += len(text.encode("utf-8"))
            row = json.dumps({"text": text, "path": relpath}, ensure_ascii=False)
            (f_heldout if split == "heldout" else f_train).write(row + "\n")
            if split == "heldout" and (lcc := lcc_row(relpath, text, cfg)) is not None:
                f_lcc.write(json.dumps(lcc, ensure_ascii=False) + "\n")
                num_lcc += 1
    if not sum(stats.kept.values()):  # no manifest: the corpus is not finished
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(stats.rejected.items()))
        raise ValueError(f"every .py file under {root} was rejected ({reasons}); the corpus would be empty")
    manifest = {
        "root": str(root),
        "python_version": platform.python_version(),
        "heldout_frac": cfg.heldout_frac,
        "split_rule": "sha256(relative posix path)[:8] / 2**64 < heldout_frac -> heldout",
        "files_read": stats.files_read,
        "files_kept": sum(stats.kept.values()),
        "files_rejected": sum(stats.rejected.values()),
        "rejected_by_reason": dict(sorted(stats.rejected.items())),
        "rejected_paths": dict(sorted(stats.rejected_paths.items())),
        "files": {"train": stats.kept["train"], "heldout": stats.kept["heldout"]},
        "bytes": {"train": stats.bytes["train"], "heldout": stats.bytes["heldout"]},
        "lcc_rows": num_lcc,
        "options": {
            "max_file_bytes": cfg.max_file_bytes,
            "check_syntax": cfg.check_syntax,
            "lcc_min_chars": cfg.lcc_min_chars,
            "lcc_max_context_chars": cfg.lcc_max_context_chars,
            "lcc_answer_lines": cfg.lcc_answer_lines,
        },
    }
    (cfg.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def parse_args(argv: list[str] | None = None) -> CorpusConfig:
    p = ArgumentParser(  # a usage error is one line, as in every CLI here
        prog="python -m data_prep.stdlib_corpus",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--root", type=Path, default=None, help="tree to walk (default: this Python's stdlib)")
    p.add_argument("--heldout-frac", type=float, default=0.05)
    p.add_argument("--max-file-bytes", type=int, default=400_000)
    p.add_argument("--no-syntax-check", dest="check_syntax", action="store_false")
    p.add_argument("--lcc-min-chars", type=int, default=6_000)
    p.add_argument("--lcc-max-context-chars", type=int, default=48_000)
    p.add_argument("--lcc-answer-lines", type=int, default=1)
    return CorpusConfig(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    manifest = build_corpus(parse_args(argv))
    summary = {
        k: manifest[k] for k in ("python_version", "files_read", "files_kept", "files_rejected", "lcc_rows")
    }
    print(
        json.dumps(
            summary | {"rejected_by_reason": manifest["rejected_by_reason"], "bytes": manifest["bytes"]}
        )
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))  # user errors: one line, exit 2 (--debug: traceback)
