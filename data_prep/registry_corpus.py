"""Build a code + prose corpus from pinned registry packages and the local Python standard library (issue 9).

    python -m data_prep.registry_corpus --out DIR [--sources default|none|FILE.json] [--cache DIR] \
        [--stdlib-root PATH | --no-stdlib] [--heldout-frac 0.05] [--offline]

Reads every pinned archive (data_prep.registry_sources: PyPI sdists and a Debian documentation package, each
verified against its SHA-256), takes the Python sources (kind "code") and the documentation (kind "prose": reST,
Markdown, .txt in documentation folders, HTML converted to text), drops junk (data_prep.archive_text.TextFilter)
and exact duplicates, and writes into DIR:
- ``train.jsonl`` / ``heldout.jsonl``: rows ``{"text", "source", "path", "kind", "licence"}``;
- ``manifest.json``: per source its version, archive, SHA-256, licence (pinned and as the package states it),
  files read / kept / rejected by reason; per split files, bytes and kinds; the split rule.

The held-out split is by file and fixed before any training: sha256 of the split key, as a fraction of 2**64,
below --heldout-frac. The key is ``source:path`` (path inside the package, without the versioned top folder, so a
version bump keeps the split) and, for the standard library, the bare relative path: exactly the key
data_prep.stdlib_corpus uses, so both corpora hold out the same stdlib modules.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import platform
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from data_prep.archive_text import TextFilter, extract_text, iter_archive
from data_prep.registry_sources import DEBIAN_MIRROR, PYPI_INDEX, fetch, load_sources, metadata_licence
from data_prep.stdlib_corpus import default_stdlib_root, iter_python_files, split_of
from longspec.cli import USER_ERRORS, ArgumentParser, one_line
from longspec.ownership import claim_output_dir

log = logging.getLogger("data_prep")

STDLIB_SOURCE = "python-stdlib"
SPLIT_RULE = (
    "sha256(key)[:8] / 2**64 < heldout_frac -> heldout; key = 'source:path' "
    "(python-stdlib: the bare relative path, as data_prep.stdlib_corpus)"
)


@dataclass(kw_only=True)
class RegistryCorpusConfig:
    out: Path
    sources: str = "default"  # default | none | JSON file (data_prep.registry_sources.load_sources)
    cache: Path = Path.home() / ".cache" / "longspec" / "registry"
    stdlib_root: Path | None = None  # None: this interpreter's stdlib
    stdlib: bool = True
    heldout_frac: float = 0.05
    max_file_bytes: int = 400_000
    min_chars: int = 400
    offline: bool = False  # use only archives already in the cache
    index_url: str = PYPI_INDEX
    debian_mirror: str = DEBIAN_MIRROR

    def __post_init__(self):
        if not 0.0 < self.heldout_frac < 1.0:
            raise ValueError(f"heldout_frac must be in (0, 1), got {self.heldout_frac}")
        if self.max_file_bytes <= 0 or self.min_chars < 0:
            raise ValueError("max_file_bytes must be positive and min_chars >= 0")


def split_key(source: str, path: str) -> str:
    return path if source == STDLIB_SOURCE else f"{source}:{path}"


@dataclass
class _SourceStats:
    files_read: int = 0
    kept: Counter = field(default_factory=Counter)  # split -> files
    kinds: Counter = field(default_factory=Counter)  # kind -> files kept
    bytes: Counter = field(default_factory=Counter)  # split -> UTF-8 bytes
    rejected: Counter = field(default_factory=Counter)  # reason -> files

    def to_dict(self) -> dict:
        return {
            "files_read": self.files_read,
            "files": {"train": self.kept["train"], "heldout": self.kept["heldout"]},
            "kinds": dict(sorted(self.kinds.items())),
            "bytes": {"train": self.bytes["train"], "heldout": self.bytes["heldout"]},
            "rejected_by_reason": dict(sorted(self.rejected.items())),
        }


class _Writer:
    """The two split files plus exact-duplicate removal across every source (first occurrence wins: sources are
    read in their listed order, the stdlib last)."""

    def __init__(self, out: Path, heldout_frac: float):
        claim_output_dir(out, "corpus", what="--out")
        self.files = {s: open(out / f"{s}.jsonl", "w", encoding="utf-8") for s in ("train", "heldout")}
        self.heldout_frac = heldout_frac
        self.seen: set[bytes] = set()

    def add(self, stats: _SourceStats, *, source: str, path: str, kind: str, text: str, licence: str) -> None:
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        if digest in self.seen:
            stats.rejected["duplicate"] += 1
            return
        self.seen.add(digest)
        split = split_of(split_key(source, path), self.heldout_frac)
        row = {"text": text, "source": source, "path": path, "kind": kind, "licence": licence}
        self.files[split].write(json.dumps(row, ensure_ascii=False) + "\n")
        stats.kept[split] += 1
        stats.kinds[kind] += 1
        stats.bytes[split] += len(text.encode("utf-8"))

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def build_registry_corpus(cfg: RegistryCorpusConfig) -> dict:
    """Fetch, extract, filter, split; write the JSONL splits and manifest.json; return the manifest."""
    sources = load_sources(cfg.sources)
    if not sources and not cfg.stdlib:  # was an empty corpus and exit 0
        raise ValueError("no sources and --no-stdlib: nothing to build the corpus from")
    text_filter = TextFilter(max_file_bytes=cfg.max_file_bytes, min_chars=cfg.min_chars)
    writer = _Writer(cfg.out, cfg.heldout_frac)
    manifest_sources = []
    try:
        for source in sources:
            data = fetch(
                source, cfg.cache, index=cfg.index_url, mirror=cfg.debian_mirror, offline=cfg.offline
            )
            members = dict(iter_archive(source.archive_name, data))
            stats = _SourceStats()
            for path, raw in members.items():
                if not path.startswith(source.include):
                    continue
                rel = path[len(source.include) :]
                kind, text, reason = extract_text(rel, raw, text_filter)
                if kind is None:
                    continue
                stats.files_read += 1
                if reason is not None:
                    stats.rejected[reason] += 1
                    continue
                writer.add(stats, source=source.name, path=rel, kind=kind, text=text, licence=source.licence)
            log.info("%s %s: %s", source.name, source.version, stats.to_dict())
            manifest_sources.append(
                source.to_dict()
                | {
                    "archive_bytes": len(data),
                    "sha256_verified": True,
                    "licence_metadata": metadata_licence(members),
                }
                | stats.to_dict()
            )
        if cfg.stdlib:
            manifest_sources.append(_add_stdlib(cfg, writer, text_filter))
    finally:
        writer.close()
    totals: dict = defaultdict(Counter)
    for entry in manifest_sources:
        for key in ("files", "bytes", "kinds", "rejected_by_reason"):
            totals[key].update(entry[key])
    manifest = {
        "heldout_frac": cfg.heldout_frac,
        "split_rule": SPLIT_RULE,
        "sources": manifest_sources,
        "files": dict(totals["files"]),
        "bytes": dict(totals["bytes"]),
        "kinds": dict(sorted(totals["kinds"].items())),
        "rejected_by_reason": dict(sorted(totals["rejected_by_reason"].items())),
        "options": {"max_file_bytes": cfg.max_file_bytes, "min_chars": cfg.min_chars},
    }
    (cfg.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def _add_stdlib(cfg: RegistryCorpusConfig, writer: _Writer, text_filter: TextFilter) -> dict:
    root = (cfg.stdlib_root or default_stdlib_root()).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib root {root} is not a directory (pass --stdlib-root or --no-stdlib)")
    stats = _SourceStats()
    for path in iter_python_files(root):
        rel = path.relative_to(root).as_posix()
        stats.files_read += 1
        text, reason = text_filter(rel, "code", path.read_bytes())
        if reason is not None:
            stats.rejected[reason] += 1
            continue
        writer.add(stats, source=STDLIB_SOURCE, path=rel, kind="code", text=text, licence="PSF-2.0")
    return {
        "registry": "local",
        "name": STDLIB_SOURCE,
        "version": platform.python_version(),
        "root": str(root),
        "licence": "PSF-2.0",
    } | stats.to_dict()


def parse_args(argv: list[str] | None = None) -> RegistryCorpusConfig:
    p = ArgumentParser(  # a usage error is one line (a UserError), as in every CLI here
        prog="python -m data_prep.registry_corpus",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--sources", default="default", help="default | none | a JSON list of pinned sources")
    p.add_argument("--cache", type=Path, default=RegistryCorpusConfig.__dataclass_fields__["cache"].default,
                   help="downloaded archives (reused when their sha256 matches)")  # fmt: skip
    p.add_argument("--stdlib-root", type=Path, default=None, help="default: this Python's standard library")
    p.add_argument("--no-stdlib", dest="stdlib", action="store_false")
    p.add_argument("--heldout-frac", type=float, default=0.05)
    p.add_argument("--max-file-bytes", type=int, default=400_000)
    p.add_argument("--min-chars", type=int, default=400)
    p.add_argument("--offline", action="store_true", help="never download: every archive must be in --cache")
    p.add_argument("--index-url", default=PYPI_INDEX)
    p.add_argument("--debian-mirror", default=DEBIAN_MIRROR)
    return RegistryCorpusConfig(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        cfg = parse_args([a for a in (argv if argv is not None else sys.argv[1:]) if a != "--debug"])
        manifest = build_registry_corpus(cfg)
    except (*USER_ERRORS, OSError) as e:
        if debug:
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    print(json.dumps({k: manifest[k] for k in ("files", "bytes", "kinds", "rejected_by_reason")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
