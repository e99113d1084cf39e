"""The repository explains itself: no citation of a file that is not in it, every "ALGORITHM §N" a comment or doc
cites exists in docs/ALGORITHM.md, and every relative Markdown link resolves inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("longspec", "data_prep", "benchmarks", "tests", "launch", "docs", "README.md")
SUFFIXES = {".py", ".md", ".sh", ".yaml", ".toml"}
ALGORITHM = ROOT / "docs" / "ALGORITHM.md"

# Files that live outside the repository (an external algorithm write-up, machine notes, a sibling checkout).
# Spelled in pieces so this file does not match itself.
OUTSIDE = re.compile(
    "|".join(
        [
            r"\bREFERENCE(?:\.md| §)",
            r"\bCPU" + r"\.md\b",
            r"\bDEVICE" + r"\.md\b",
            r"\.\./" + r"shared\b",
            r"device" + r"-wheels",
        ]
    )
)
CITATION = re.compile(r"ALGORITHM(?:\.md)? §(\d+(?:\.\d+)*)")
SECTION = re.compile(r"^#{2,3} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _files() -> list[Path]:
    out = []
    for name in SCANNED:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        out += [
            p
            for p in candidates
            if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts and ".dw" not in p.parts
        ]
    return out


def _hits(pattern: re.Pattern) -> list[tuple[str, int, str]]:
    hits = []
    for path in _files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in pattern.finditer(line):
                hits.append((str(path.relative_to(ROOT)), lineno, match.group(0)))
    return hits


def test_the_scan_sees_the_repository():
    names = {str(p.relative_to(ROOT)) for p in _files()}
    assert {"docs/ALGORITHM.md", "longspec/drafter/model.py", "tests/test_docs.py", "README.md"} <= names


def test_the_outside_pattern_catches_what_it_should():
    outside = ["see REFERENCE" + " §4", "REFERENCE" + ".md", "CPU" + ".md", "(../" + "shared DEVICE" + ".md)"]
    for text in outside:
        assert OUTSIDE.search(text), text
    assert not OUTSIDE.search("GREEDY_REFERENCES = ('ar',)")


def test_no_citation_of_files_outside_the_repository():
    assert _hits(OUTSIDE) == []


def test_every_cited_algorithm_section_exists():
    sections = set(SECTION.findall(ALGORITHM.read_text(encoding="utf-8")))
    numbered = "1 2 3 3.1 3.2 3.3 3.4 4 4.1 4.2 4.3 4.4 4.5 5".split()
    assert set(numbered) <= sections
    cited = _hits(CITATION)
    assert cited, "nothing cites docs/ALGORITHM.md"
    missing = [(f, n, c) for f, n, c in cited if CITATION.match(c).group(1) not in sections]
    assert missing == []


@pytest.mark.parametrize("doc", sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"]), ids=lambda p: p.name)
def test_relative_markdown_links_resolve_inside_the_repository(doc):
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        resolved = (doc.parent / target.split("#", 1)[0]).resolve()
        assert resolved.is_relative_to(ROOT) and resolved.exists(), f"{doc.name}: {target}"
