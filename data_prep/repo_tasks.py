"""Repository-level code completion in RepoBench-P's spirit, cut from one package's files (issue 45).

A row: the other files of the current file's package as context -- first the files it imports (resolved from its
import statements, in statement order), then the rest of its folder, then the rest of the package -- each headed by
`# Path: <path>`, cut at a line end where the budget ends; then the current file (headed the same way) cut at a
line end; the answer is the next non-blank line. The cut prefers a line that uses a name imported from another
file of the package (RepoBench-P asks for such lines), chosen by a hash of the file's key, so a rebuild is
identical. Fields as LongBench's repobench-p rows: `context` the cross-file code, `input` the in-file code.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Callable

from data_prep.doc_tasks import boundaries, doc_key, fit_prefix, next_code_line
from data_prep.stdlib_corpus import path_fraction

__all__ = ["PackageIndex", "module_name", "imports_of", "cut_repo_task"]

IN_FILE_SHARE = 0.5  # the in-file code takes at most this share of the budget (cross-file context the rest)
MIN_ANSWER_CHARS = 8  # shorter next lines ("else:", ")") test little


def module_name(path: str) -> str | None:
    """The dotted module of a `.py` path ("lib/pkg/sub/__init__.py" -> "lib.pkg.sub"), None for other files."""
    if not path.endswith(".py"):
        return None
    parts = path[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or None


def _parse(text: str) -> ast.Module | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


class PackageIndex:
    """The code files of one package, found by dotted module name. A file is registered under every suffix of
    its dotted path ("lib.pkg.sub", "pkg.sub", "sub"), the first file by path winning a shared suffix, so an
    absolute import resolves whatever folder (src/, lib/) the package keeps its code in."""

    def __init__(self, docs: list[dict]):
        self.docs = sorted((d for d in docs if d["kind"] == "code"), key=lambda d: d["path"])
        self.by_name: dict[str, dict] = {}
        for doc in self.docs:
            name = module_name(doc["path"])
            if name is None:
                continue
            parts = name.split(".")
            for start in range(len(parts)):
                self.by_name.setdefault(".".join(parts[start:]), doc)

    def resolve(self, name: str) -> dict | None:
        return self.by_name.get(name)


def imports_of(doc: dict, index: PackageIndex) -> tuple[list[dict], set[str]]:
    """(the package's files `doc` imports, in statement order, without repeats or itself; the names those
    imports bind in `doc`)."""
    tree = _parse(doc["text"])
    if tree is None:
        return [], set()
    own = module_name(doc["path"]) or ""
    package = own.split(".") if doc["path"].endswith("__init__.py") else own.split(".")[:-1]
    nodes = sorted((n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))),
                   key=lambda n: (n.lineno, n.col_offset))  # fmt: skip
    found: list[dict] = []
    bound: set[str] = set()

    def add(target: dict | None, names: list[str]) -> None:
        if target is None or target is doc:
            return
        bound.update(names)
        if all(target is not f for f in found):
            found.append(target)

    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(index.resolve(alias.name), [alias.asname or alias.name.split(".")[0]])
            continue
        if node.level:  # relative: from the current package, one level up per extra dot
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = node.module or ""
        for alias in node.names:
            bound_name = alias.asname or alias.name
            # `from pkg import sub` names a module when one exists, else a name inside pkg
            add(index.resolve(f"{module}.{alias.name}") or index.resolve(module), [bound_name])
    return found, bound


def _header(path: str) -> str:
    return f"# Path: {path}\n"


def _context_files(doc: dict, index: PackageIndex, imported: list[dict]) -> list[dict]:
    """Cross-file context in priority order: the imported files, the current folder's, the package's others."""
    folder = doc["path"].rsplit("/", 1)[0] if "/" in doc["path"] else ""
    seen = {id(doc), *map(id, imported)}
    rest = [d for d in index.docs if id(d) not in seen]
    same = [d for d in rest if (d["path"].rsplit("/", 1)[0] if "/" in d["path"] else "") == folder]
    others = [d for d in rest if all(d is not s for s in same)]
    key = doc_key(doc)
    return [*imported, *sorted(same, key=lambda d: path_fraction(key + d["path"], salt="repo-context")),
            *sorted(others, key=lambda d: path_fraction(key + d["path"], salt="repo-context"))]  # fmt: skip


def _cut_points(text: str, bound: set[str]) -> list[int]:
    """Line ends after which the next non-blank line is worth predicting: one using an imported name, when
    there is any such line (after the imports themselves), else any line of >= MIN_ANSWER_CHARS characters."""
    last = text.rstrip().rfind("\n")
    ends = [e for e in boundaries(text, "code") if e <= last]
    good, uses = [], []
    for end in ends:
        line = next_code_line(text, end)
        if line is None or len(line.strip()) < MIN_ANSWER_CHARS:
            continue
        good.append(end)
        stripped = line.strip()
        if not stripped.startswith(("import ", "from ", "#")) and any(name in stripped for name in bound):
            uses.append(end)
    return uses or good


def cut_repo_task(
    doc: dict, index: PackageIndex, count: Callable[[str, str], int], budget: int
) -> dict | None:
    """One repository-level completion row whose prompt, as count(context, input) measures it, fits `budget`:
    {"context", "instruction" (the in-file code: the row's `input`), "answer", "context_paths"} or None (`doc` is no code, or has no usable line)."""
    if doc["kind"] != "code":
        return None
    imported, bound = imports_of(doc, index)
    if not imported:  # nothing of its own package imported: not a repository-level task
        return None
    text = doc["text"]
    points = _cut_points(text, bound)
    if not points:
        return None
    header = _header(doc["path"])
    # The cut: a hash-chosen point in the file's second half, pulled earlier while the in-file code is over its share.
    late = [p for p in points if p >= len(text) // 2] or points
    cut = late[int(path_fraction(doc_key(doc), salt="repo-cut") * len(late))]
    in_file = fit_prefix(header + text, [len(header) + p for p in points if p <= cut],
                         lambda p: count("", p), int(IN_FILE_SHARE * budget))  # fmt: skip
    if in_file is None:
        return None
    answer = next_code_line(text, len(in_file) - len(header))
    # Cross-file context: the files in priority order, cut at a line end where the budget ends.
    room = budget - count("", in_file)
    parts, chars = [], 0
    for other in _context_files(doc, index, imported):
        parts.append(_header(other["path"]) + other["text"].rstrip("\n") + "\n\n")
        chars += len(parts[-1])
        if chars > 6 * room:  # more than enough: a token is rarely over 6 characters of code
            break
    context_text = "".join(parts)
    context = fit_prefix(context_text, boundaries(context_text, "code"), lambda p: count(p, in_file), budget)
    if context is None:
        return None
    paths = [p for p, start in _starts(parts) if start < len(context)]
    return {"context": context, "instruction": in_file, "answer": answer, "context_paths": paths}


def _starts(parts: list[str]) -> list[tuple[str, int]]:
    """(path, character offset in the joined context) of each file in `parts`."""
    found, offset = [], 0
    for part in parts:
        found.append((part[len("# Path: ") : part.index("\n")], offset))
        offset += len(part)
    return found
