"""The repository explains itself: no citation of a file that is not in it, every "ALGORITHM §N" a comment or doc
cites exists in docs/ALGORITHM.md, every relative Markdown link (and its #anchor) resolves inside the repository,
and the documents for users keep to their sizes: the README opens with a few lines and the headline table,
BENCHMARKS and ARCHITECTURE fit in 300 lines."""

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
SECTION = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.MULTILINE)
DOCS = sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md"])


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
    numbered = (
        "1 2 3 3.1 3.2 3.3 3.4 4 4.1 4.2 4.3 4.4 4.5 4.5.1 4.5.2 4.5.3 4.5.4 4.5.5 4.5.6 4.5.7 4.6 5".split()
    )
    assert set(numbered) <= sections
    cited = _hits(CITATION)
    assert cited, "nothing cites docs/ALGORITHM.md"
    missing = [(f, n, c) for f, n, c in cited if CITATION.match(c).group(1) not in sections]
    assert missing == []


def _anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, a repeated
    one numbered."""
    seen: dict[str, int] = {}
    for title in HEADING.findall(doc.read_text(encoding="utf-8")):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def test_anchors_are_githubs():
    doc = ROOT / "docs" / "BENCHMARKS.md"
    assert "smollm2-at-t1-speculation-does-not-pay" in _anchors(doc)
    assert "τ-on-the-real-smollm2-135m-instruct-the-papers-tree" in _anchors(doc)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_markdown_links_resolve_inside_the_repository(doc):
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        assert resolved.is_relative_to(ROOT) and resolved.exists(), f"{doc.name}: {target}"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{doc.name}: {target}"


def test_the_readme_opens_with_three_lines_and_the_headline_table():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("# ")
    table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    assert len([line for line in lines[1:table] if line.strip()]) <= 3
    rows = []
    for line in lines[table:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    assert len(rows) == 2 + 5  # header, rule, five rows
    assert all("docs/BENCHMARKS.md#" in row for row in rows[2:])


@pytest.mark.parametrize("name", ["BENCHMARKS.md", "ARCHITECTURE.md"])
def test_benchmarks_and_architecture_fit_in_300_lines(name):
    assert len((ROOT / "docs" / name).read_text(encoding="utf-8").splitlines()) <= 300


def test_architecture_lines_are_at_most_120_characters():
    lines = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8").splitlines()
    assert [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > 120] == []


def test_benchmarks_say_what_the_target_wrote():
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert "distinct" in text and "notes/benchmark-log.md" in text
