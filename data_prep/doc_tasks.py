"""Long-context tasks cut mechanically out of corpus documents: shared by the stage-3 prompt builder (train split)
and the instruct evaluation suite (held-out split).

- code completion: a Python file's prefix, cut at a line end;
- summarisation: a document (or its prefix, cut at a paragraph end);
- document QA: a question about a named section (reST / Markdown / HTML-converted heading) or a class / function
  the document contains, asked only about what the kept prefix really shows.
Every choice (cut point, which section) comes from a hash of the document's key, so a rebuild is identical.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable

from data_prep.stdlib_corpus import path_fraction

__all__ = [
    "TASKS",
    "boundaries",
    "fit_prefix",
    "headings",
    "code_symbols",
    "question",
    "next_code_line",
    "doc_key",
    "cut_task",
    "ordered",
]

SUMMARY_INSTRUCTION = "Now, write a one-page summary of the document above."
CODE_INSTRUCTION = "Continue this Python file from where it stops. Write only the code that comes next."
QA_INSTRUCTION = "Answer the question based on the document above in one or more sentences."

_RST_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1{2,}\s*$")
_MD_HEADING = re.compile(r"^(#{1,4})\s+(\S.*?)\s*#*\s*$")


def doc_key(row: dict) -> str:
    return f"{row.get('source', '')}:{row['path']}"


def boundaries(text: str, kind: str) -> list[int]:
    """Character offsets where a prefix may end: after each line (code) or each paragraph (prose; after each
    line inside a paragraph that has no blank lines for a long stretch, so no prose document is unsplittable)."""
    ends = [m.end() for m in re.finditer(r"\n", text)]
    if kind == "code" or not ends:
        return ends or [len(text)]
    paragraph = [m.end() for m in re.finditer(r"\n[ \t]*\n", text)]
    return paragraph if len(paragraph) >= max(4, len(ends) // 40) else ends


def fit_prefix(text: str, ends: list[int], count: Callable[[str], int], budget: int) -> str | None:
    """The longest text[:end] over `ends` with count(prefix) <= budget (binary search: count is monotone in the
    prefix). None when even the shortest prefix does not fit."""
    lo, hi = 0, len(ends) - 1
    if count(text[: ends[-1]]) <= budget:  # the whole text fits: no search (a document under its budget)
        return text[: ends[-1]]
    if count(text[: ends[0]]) > budget:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[: ends[mid]]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text[: ends[lo]]


def fit_document(text: str, kind: str, count: Callable[[str], int], budget: int) -> str | None:
    """fit_prefix for a document: code at line ends; prose at paragraph ends, unless that leaves over a tenth
    of the budget unused (long paragraphs), then at line ends, then (a paragraph per line) at sentence ends."""
    if kind == "code":
        return fit_prefix(text, boundaries(text, "code"), count, budget)
    prefix = None
    for ends in (boundaries(text, kind), boundaries(text, "code"), _sentence_ends(text)):
        prefix = fit_prefix(text, ends, count, budget) if ends else None
        if prefix is not None and (len(prefix) == len(text) or count(prefix) >= 0.9 * budget):
            return prefix
    return prefix


def _sentence_ends(text: str) -> list[int]:
    return [m.end() for m in re.finditer(r"[.!?:]\s", text)]


def headings(text: str) -> list[tuple[int, str]]:
    """(line index, title) of the section headings: reST titles (a line underlined with =, -, ~, ...) and
    Markdown / HTML-converted '#' headings."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if (m := _MD_HEADING.match(line)) is not None:
            found.append((i, m.group(2)))
        elif (
            i + 1 < len(lines)
            and _RST_UNDERLINE.match(lines[i + 1])
            and line.strip()
            and not _RST_UNDERLINE.match(line)
            and len(lines[i + 1].rstrip()) >= len(line.rstrip())
        ):
            found.append((i, line.strip()))
    # Titles that are markup rather than words (":mod:`os`" stays, "....." or "1." does not) make poor questions.
    return [
        (i, t.strip("`*_ ")) for i, t in found if len(re.findall(r"[A-Za-z]{3,}", t)) >= 1 and len(t) <= 80
    ]


def code_symbols(text: str) -> list[tuple[str, str]]:
    """(kind, name) of the classes and functions (top level and methods) with a docstring or >= 5 lines."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            long_enough = (node.end_lineno or node.lineno) - node.lineno >= 4
            if (ast.get_docstring(node) or long_enough) and not node.name.startswith("__"):
                found.append(("class" if isinstance(node, ast.ClassDef) else "function", node.name))
    return found


def question(key: str, kind: str, text: str) -> str | None:
    """A question the document `text` answers, chosen by the hash of `key` (None: nothing to ask about)."""
    pick = path_fraction(key, salt="question")
    if kind == "code":
        symbols = code_symbols(text)
        if not symbols:
            return None
        what, name = symbols[int(pick * len(symbols))]
        if what == "class":
            return f"What is the class `{name}` in this file for, and what are its main methods?"
        return f"What does the function `{name}` in this file do, and what arguments does it take?"
    titles = headings(text)
    if len(titles) < 2:
        return None
    _, title = titles[1:][int(pick * (len(titles) - 1))]  # not the document's own title
    templates = (
        'What does the section "{t}" of this document explain?',
        'According to the section "{t}", what should a reader know or do?',
        'Summarise the main points of the section "{t}" in a few sentences.',
    )
    return templates[int(path_fraction(key, salt="question-form") * len(templates))].format(t=title)


def next_code_line(text: str, cut: int) -> str | None:
    """The first non-blank line at or after character `cut` (LCC's answer), None if there is none."""
    for line in text[cut:].splitlines():
        if line.strip():
            return line
    return None


TASKS = ("code", "summary", "qa")
QUESTION_RESERVE = (
    16  # extra tokens kept free for a question about the prefix longer than the whole document's
)


def cut_task(task: str, doc: dict, count: Callable[[str, str], int], budget: int) -> dict | None:
    """One task instance from corpus row `doc` whose prompt, as measured by count(context, instruction), fits
    `budget` tokens: {"context", "instruction", "answer"} or None (the document does not suit the task).

    code: `doc` must be code; the context is the longest line-prefix that fits and still has a line after it,
    the answer that next non-blank line. summary: a prose document's longest paragraph-prefix that fits. qa: the
    same with a question about a section / symbol inside the kept prefix; answer None (the target writes it)."""
    text, kind, key = doc["text"], doc["kind"], doc_key(doc)
    if task == "code":
        if kind != "code":
            return None
        last = text.rstrip().rfind("\n")  # a cut must leave the file's last line as a possible answer
        ends = [e for e in boundaries(text, "code") if e <= last]
        if not ends:
            return None
        context = fit_prefix(text, ends, lambda p: count(p, ""), budget)
        answer = None if context is None else next_code_line(text, len(context))
        return None if answer is None else {"context": context, "instruction": "", "answer": answer}
    if task == "summary":
        if kind != "prose":
            return None
        context = fit_document(text, kind, lambda p: count(p, SUMMARY_INSTRUCTION), budget)
        return (
            None
            if context is None
            else {"context": context, "instruction": SUMMARY_INSTRUCTION, "answer": None}
        )
    if task == "qa":
        # The question must be about the kept prefix, which depends on the room the question leaves: reserve
        # the room of the whole document's question plus a margin, fit, then ask about the prefix.
        whole = question(key, kind, text)
        if whole is None:
            return None
        reserve = count("", _qa_instruction(whole)) - count("", "") + QUESTION_RESERVE
        context = fit_document(text, kind, lambda p: count(p, ""), budget - reserve)
        asked = None if context is None else question(key, kind, context)
        if asked is None:
            return None
        instruction = _qa_instruction(asked)
        if count(context, instruction) > budget:
            return None
        return {"context": context, "instruction": instruction, "answer": None}
    raise ValueError(f"unknown task {task!r}; one of {TASKS}")


def _qa_instruction(asked: str) -> str:
    return f"{QA_INSTRUCTION}\n\nQuestion: {asked}"


def ordered(rows: list[dict], salt: str) -> list[dict]:
    """Rows in a stable pseudo-random order (hash of each document's key), independent of file order."""
    return sorted(rows, key=lambda r: path_fraction(doc_key(r), salt=salt))
