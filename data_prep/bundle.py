"""A compact data bundle for one GPU run (a run carries at most 64 MiB): stage-1 text, stage-2 long documents,
stage-3 prompts and the eval suite, gzip'd where the prep tools read gzip (issue 9).

    python -m data_prep.bundle --corpus DIR --tokenizer T --out DIR --long-docs long.jsonl \
        --prompts prompts.jsonl --suite SUITE_DIR [--stage1-tokens 10000000] [--gzip-suite]

The layout is the one `python -m longspec.pipeline --preset smollm2 --data DIR` reads, gzip'd: corpus/train.jsonl.gz
(train-split rows in a stable hash order up to --stage1-tokens tokens), corpus/long_docs.jsonl.gz (stage 2),
stage3_prompts.jsonl.gz, suite/*.jsonl (plain; gzip'd with --gzip-suite: a 32K-token suite is ~10 MB of text) and
manifest.json (files, bytes, token counts of every corpus split
and of each bundled part). `gunzip -r DIR` restores plain JSONL; data_prep.stage1 / stage2 also read the .gz files
as they are.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

from data_prep.common import batched, load_tokenizer
from data_prep.doc_tasks import ordered
from data_prep.instruct_suite import read_rows
from longspec.cli import ArgumentParser
from longspec.ownership import claim_output_dir


def count_tokens(tokenizer, texts) -> int:
    return sum(
        len(ids)
        for batch in batched(texts, 256)
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]
    )


def _gzip_copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as fin, gzip.open(dst, "wb", compresslevel=9) as fout:
        shutil.copyfileobj(fin, fout)


def _read_part(path: Path, flag: str, tool: str) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {str(path)!r} does not exist (python -m {tool} --out FILE)")
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"{flag} {str(path)!r} holds no row")
    return rows


def build_bundle(*, corpus: Path, tokenizer, out: Path, long_docs: Path, prompts: Path, suite: Path,
                 stage1_tokens: int = 10_000_000, gzip_suite: bool = False) -> dict:  # fmt: skip
    # Every part is checked before the first write: a missing suite directory, an empty part or a token budget
    # of 0 made a bundle with exit 0 that the pipeline then failed on, a step or a GPU job later.
    if stage1_tokens < 1:
        raise ValueError(f"--stage1-tokens must be >= 1, got {stage1_tokens}")
    long_rows = _read_part(long_docs, "--long-docs", "data_prep.long_documents")
    prompt_rows = _read_part(prompts, "--prompts", "data_prep.instruct_prompts")
    suite_files = (
        sorted(p for p in suite.glob("*.json*") if p.name != "manifest.json") if suite.is_dir() else []
    )
    if not any(p.stat().st_size for p in suite_files):
        raise ValueError(
            f"--suite {str(suite)!r} holds no eval suite (python -m data_prep.instruct_suite --out DIR)"
        )
    train = read_rows(corpus / "train.jsonl")
    heldout = read_rows(corpus / "heldout.jsonl")
    claim_output_dir(out, "bundle", what="--out")
    manifest: dict = {"corpus_tokens": {}, "corpus_files": {}, "parts": {}}
    for split, rows in (("train", train), ("heldout", heldout)):
        manifest["corpus_files"][split] = len(rows)
        manifest["corpus_tokens"][split] = count_tokens(tokenizer, (r["text"] for r in rows))

    taken = tokens = 0
    (out / "corpus").mkdir(exist_ok=True)
    with gzip.open(out / "corpus" / "train.jsonl.gz", "wt", encoding="utf-8", compresslevel=9) as f:
        for batch in batched(ordered(train, salt="bundle-stage1"), 256):
            for row, ids in zip(batch, tokenizer([r["text"] for r in batch], add_special_tokens=False)["input_ids"],
                                strict=True):  # fmt: skip
                if tokens >= stage1_tokens:
                    break
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                taken += 1
                tokens += len(ids)
            if tokens >= stage1_tokens:
                break
    manifest["parts"]["corpus/train.jsonl.gz"] = {"rows": taken, "tokens": tokens}
    _gzip_copy(long_docs, out / "corpus" / "long_docs.jsonl.gz")
    manifest["parts"]["corpus/long_docs.jsonl.gz"] = {
        "rows": len(long_rows),
        "tokens": sum(r["tokens"] for r in long_rows),
    }
    _gzip_copy(prompts, out / "stage3_prompts.jsonl.gz")
    manifest["parts"]["stage3_prompts.jsonl.gz"] = {
        "rows": len(prompt_rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in prompt_rows),
        "max_prompt_tokens": max(r["prompt_tokens"] for r in prompt_rows),
    }
    (out / "suite").mkdir(exist_ok=True)
    for path in sorted(suite.glob("*.json*")):
        if gzip_suite and path.name.endswith(".jsonl"):
            _gzip_copy(path, out / "suite" / f"{path.name}.gz")
        else:
            shutil.copy(path, out / "suite" / path.name)
    manifest["bytes"] = {  # not this manifest: a rerun counted the previous one's bytes
        p.relative_to(out).as_posix(): p.stat().st_size
        for p in sorted(out.rglob("*"))
        if p.is_file() and p != out / "manifest.json"
    }
    manifest["total_bytes"] = sum(manifest["bytes"].values())
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def _main(argv: list[str] | None) -> int:
    p = ArgumentParser(prog="python -m data_prep.bundle", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--long-docs", type=Path, required=True, help="data_prep.long_documents output")
    p.add_argument("--prompts", type=Path, required=True, help="data_prep.instruct_prompts output")
    p.add_argument("--suite", type=Path, required=True, help="data_prep.instruct_suite output dir")
    p.add_argument("--stage1-tokens", type=int, default=10_000_000)
    p.add_argument(
        "--gzip-suite", action="store_true", help="gzip the suite's JSONL files too (gunzip -r restores)"
    )
    args = p.parse_args(argv)
    manifest = build_bundle(corpus=args.corpus, tokenizer=load_tokenizer(args.tokenizer), out=args.out,
                            long_docs=args.long_docs, prompts=args.prompts, suite=args.suite,
                            stage1_tokens=args.stage1_tokens, gzip_suite=args.gzip_suite)  # fmt: skip
    print(json.dumps({k: manifest[k] for k in ("corpus_tokens", "parts", "total_bytes")}))
    return 0


def main(argv: list[str] | None = None) -> int:
    from longspec.cli import run_cli  # one line on stderr and exit 2 for a user error, like every CLI here

    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
