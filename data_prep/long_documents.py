"""Stage-2 long documents from the registry corpus: a package's files joined up to --max-tokens (issue 9).

    python -m data_prep.long_documents --corpus DIR --tokenizer T --out long.jsonl \
        [--max-tokens 8192] [--min-tokens 2048] [--max-docs N] [--split train]

Most source files and doc pages are short; stage 2 wants documents of thousands of tokens that hang together.
Files of one source, one kind (code / prose) and one folder are joined in path order (a header line names each
file), a document closing when the next file would pass --max-tokens; a file longer than that is cut at line ends
into pieces of at most --max-tokens. Documents under --min-tokens are dropped. Rows: {"text", "source", "kind",
"paths", "tokens"}: `python -m data_prep.stage2 --source long.jsonl --seq-len 8192 ...` reads them as they are.
Groups are visited in a stable hash order, so --max-docs takes a spread of packages, not the first one.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from data_prep.common import load_tokenizer
from data_prep.instruct_suite import read_rows
from data_prep.stdlib_corpus import path_fraction
from longspec.cli import ArgumentParser
from longspec.ownership import claim_output_file


def _header(kind: str, path: str) -> str:
    return f"# file: {path}\n\n" if kind == "code" else f"[{path}]\n\n"


def _pieces(text: str, offsets: list[tuple[int, int]], max_tokens: int) -> Iterator[str]:
    """`text` cut at line ends into pieces of <= max_tokens tokens (by the tokenizer's own offsets)."""
    start_tok = 0
    while start_tok < len(offsets):
        end_tok = min(start_tok + max_tokens, len(offsets))
        start_char = offsets[start_tok][0]
        end_char = offsets[end_tok - 1][1] if end_tok == len(offsets) else offsets[end_tok][0]
        if end_tok < len(offsets):
            newline = text.rfind("\n", start_char, end_char)
            if newline > start_char:
                end_char = newline + 1
        yield text[start_char:end_char]
        # Continue at the first token that starts at or after the cut.
        while start_tok < len(offsets) and offsets[start_tok][0] < end_char:
            start_tok += 1


def build_long_documents(*, corpus: Path, tokenizer, out: Path, max_tokens: int = 8192, min_tokens: int = 2048,
                         max_docs: int | None = None, split: str = "train") -> dict:  # fmt: skip
    if not 0 < min_tokens <= max_tokens:
        raise ValueError(f"need 0 < min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    claim_output_file(out, "long-documents")
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for row in read_rows(corpus / f"{split}.jsonl"):
        groups[
            (row["source"], row["kind"], row["path"].rsplit("/", 1)[0] if "/" in row["path"] else "")
        ].append(row)
    order = sorted(groups, key=lambda g: path_fraction(":".join(g), salt="long-documents"))
    budget = max_tokens - 2  # room for the BOS / EOS stage 2 adds
    written = tokens_total = 0
    with open(out, "w", encoding="utf-8") as f:

        def emit(parts: list[str], paths: list[str], tokens: int, source: str, kind: str) -> None:
            nonlocal written, tokens_total
            if tokens >= min_tokens and (max_docs is None or written < max_docs):
                row = {
                    "text": "".join(parts),
                    "source": source,
                    "kind": kind,
                    "paths": paths,
                    "tokens": tokens,
                }
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                written += 1
                tokens_total += tokens

        for source, kind, _folder in order:
            if max_docs is not None and written >= max_docs:
                break
            rows = sorted(groups[(source, kind, _folder)], key=lambda r: r["path"])
            texts = [_header(kind, r["path"]) + r["text"].rstrip("\n") + "\n\n" for r in rows]
            enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
            parts, paths, tokens = [], [], 0
            for row, text, ids, offsets in zip(
                rows, texts, enc["input_ids"], enc["offset_mapping"], strict=True
            ):
                if len(ids) > budget:  # a long file is a document (or several) by itself
                    for piece in _pieces(text, offsets, budget):
                        n = len(tokenizer(piece, add_special_tokens=False)["input_ids"])
                        emit([piece], [row["path"]], n, source, kind)
                    continue
                if tokens + len(ids) > budget:
                    emit(parts, paths, tokens, source, kind)
                    parts, paths, tokens = [], [], 0
                parts.append(text)
                paths.append(row["path"])
                tokens += len(ids)
            emit(parts, paths, tokens, source, kind)
    if not written:  # an empty file and exit 0 failed later, at the stage-2 prep; say why here
        out.unlink()
        raise ValueError(
            f"{corpus / f'{split}.jsonl'} has no document of >= {min_tokens} tokens ({sum(map(len, groups.values()))} "
            "files read); lower --min-tokens or build a larger corpus"
        )
    return {"documents": written, "tokens": tokens_total}


def _main(argv: list[str] | None) -> int:
    p = ArgumentParser(prog="python -m data_prep.long_documents", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="registry corpus dir")
    p.add_argument("--tokenizer", required=True, help="the target's tokenizer dir")
    p.add_argument("--out", type=Path, required=True, help="output .jsonl")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--min-tokens", type=int, default=2048)
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--split", default="train", choices=("train", "heldout"))
    args = p.parse_args(argv)
    summary = build_long_documents(corpus=args.corpus, tokenizer=load_tokenizer(args.tokenizer), out=args.out,
                                   max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                                   max_docs=args.max_docs, split=args.split)  # fmt: skip
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    from longspec.cli import run_cli  # one line on stderr and exit 2 for a user error, like every CLI here

    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
