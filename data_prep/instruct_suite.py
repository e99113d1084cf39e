"""Evaluation suite for an instruct target, from HELD-OUT corpus files only, in LongBench's row schema (issue 9).

    python -m data_prep.instruct_suite --corpus DIR --tokenizer T --out DIR \
        [--buckets 2048,4096,8192] [--per-bucket 4] [--gen-room 512] [--tasks lcc,gov_report,qmsum]

Three tasks, each at every bucket (prompt length), one JSONL per task and bucket (`lcc_4k.jsonl`, `gov_report_4k`,
`qmsum_4k`: named after the LongBench task each imitates):
- `lcc` (LCC-like code completion): a held-out Python file's prefix cut at a line end; answer: the next line.
  LongBench's LCC template, as raw text with no chat template: LongBench's pred.py never chat-wraps code
  completion (the prompt is the text to continue), and an instruct target continues code that way too.
- `doc_summary` rows (GovReport-like, files gov_report_*): a held-out document, "write a one-page summary"; no reference summary exists.
- `doc_qa` rows (QMSum-like, files qmsum_*): a held-out document and a question about one of its sections / classes / functions.
- `repobench-p` (only when --tasks names it): repository-level completion, data_prep.repo_tasks -- other files of
  the current file's package as `context` (the files it imports first), the current file cut at a line end as
  `input`, the next line as the answer. Its package's files come from the held-out split too: hold out whole
  packages (data_prep.package_split) so that no file of the context was trained on.
Buckets are filled largest first: the few documents long enough for the largest bucket are not spent on a
smaller one. Summary and QA rows carry `"chat": true`: longspec.eval renders them as one user turn of the target's chat
template (LongBench's generic `{context}\\n\\n{input}` template inside it).

The full rendered prompt -- template, chat markup and special tokens included, tokenised by
longspec.eval.datasets.encode_row exactly as the eval will -- lies in [0.8, 1] x (bucket - gen_room) tokens and is
recorded as `prompt_tokens` (`length` keeps LongBench's meaning: words of the context). Evaluate with
`data.context_margin=<gen_room>` and `max_new_tokens <= gen_room` (see manifest.json's `eval_command`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from data_prep.common import load_tokenizer
from data_prep.doc_tasks import cut_task, doc_key, ordered
from data_prep.repo_tasks import PackageIndex, cut_repo_task
from longspec.cli import ArgumentParser
from longspec.eval.datasets import encode_row
from longspec.eval.prompts import NO_CHAT_TASKS
from longspec.ownership import claim_output_dir

# file stem (the LongBench task each imitates; the eval names results by file) -> (row `dataset`, doc_tasks task).
# Summary / QA rows are not `gov_report` / `qmsum` rows: those LongBench templates speak of government reports and
# meeting transcripts, so they carry their own dataset names and LongBench's generic template.
SUITE_TASKS = {"lcc": ("lcc", "code"), "gov_report": ("doc_summary", "summary"), "qmsum": ("doc_qa", "qa"),
               "repobench-p": ("repobench-p", "repo")}  # fmt: skip
DEFAULT_TASKS = ("lcc", "gov_report", "qmsum")
MIN_FILL = 0.8  # a prompt fills at least this share of its budget
INSTRUCTION_ROOM = 64  # tokens an instruction or question adds at most to a document's prompt


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found (build the corpus first: python -m data_prep.registry_corpus)"
        )
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def suite_row(dataset: str, doc: dict, cut: dict, *, bucket: int, prompt_tokens: int) -> dict:
    return {
        "_id": hashlib.sha256(f"{dataset}:{bucket}:{doc_key(doc)}".encode()).hexdigest()[:32],
        "input": cut["instruction"],
        "context": cut["context"],
        "answers": [cut["answer"]] if cut["answer"] is not None else [],
        "length": len(cut["context"].split()),  # LongBench's length: whitespace-separated words
        "dataset": dataset,
        "language": "python" if doc["kind"] == "code" else "en",
        "all_classes": None,
        "chat": dataset not in NO_CHAT_TASKS,  # code completion continues raw text, as LongBench's pred.py
        "prompt_tokens": prompt_tokens,
        "bucket": bucket,
        "source": doc["source"],
        "path": doc["path"],
        "licence": doc.get("licence"),
    } | ({"context_paths": cut["context_paths"]} if "context_paths" in cut else {})


def build_suite(*, corpus: Path, tokenizer, out: Path, buckets: list[int], per_bucket: int = 4,
                gen_room: int = 512, tasks: tuple[str, ...] = DEFAULT_TASKS) -> dict:  # fmt: skip
    unknown = [t for t in tasks if t not in SUITE_TASKS]
    if unknown or not tasks:
        raise ValueError(f"--tasks {','.join(unknown) or '(none)'}: choose from {','.join(SUITE_TASKS)}")
    if per_bucket < 1 or gen_room < 1 or any(b <= gen_room for b in buckets):
        raise ValueError("need per_bucket >= 1, gen_room >= 1 and every bucket > gen_room")
    if not buckets:
        raise ValueError("need at least one bucket (--buckets 2048,4096,...)")
    docs = read_rows(corpus / "heldout.jsonl")
    suite: dict[str, list[dict]] = {}  # written once every bucket is cut: a suite with no row writes nothing
    manifest: dict = {"corpus": str(corpus), "split": "heldout", "gen_room": gen_room, "min_fill": MIN_FILL,
                      "files": {}, "shortfalls": {}}  # fmt: skip
    packages: dict[str, PackageIndex] = {}  # the repository task's view of each held-out package
    for stem in tasks:
        dataset, task = SUITE_TASKS[stem]
        used: set[str] = set()  # a document serves one bucket of a task, so buckets differ in content
        for bucket in sorted(buckets, reverse=True):
            budget = bucket - gen_room

            def count(context: str, instruction: str, dataset=dataset) -> int:
                row = {"context": context, "input": instruction, "chat": dataset not in NO_CHAT_TASKS}
                return len(encode_row(tokenizer, row, dataset))

            rows = []
            for doc in ordered(docs, salt=f"suite-{dataset}"):
                if len(rows) == per_bucket:
                    break
                # Too few characters for the bucket's lower bound (~2 chars a token at the densest): skip early
                # (a repository row's context is other files: its own file may be short).
                if doc_key(doc) in used or (task != "repo" and len(doc["text"]) < 2 * MIN_FILL * budget):
                    continue
                # One tokenization of the whole document (instruction room aside) rules out most documents that
                # no prefix of can fill the bucket, before the binary search over its prefixes.
                if task != "repo" and count(doc["text"], "") + INSTRUCTION_ROOM < MIN_FILL * budget:
                    continue
                if task == "repo":
                    if doc["source"] not in packages:
                        packages[doc["source"]] = PackageIndex(
                            [d for d in docs if d["source"] == doc["source"]]
                        )
                    cut = cut_repo_task(doc, packages[doc["source"]], count, budget)
                else:
                    cut = cut_task(task, doc, count, budget)
                if cut is None:
                    continue
                tokens = count(cut["context"], cut["instruction"])
                if tokens < MIN_FILL * budget:
                    continue
                used.add(doc_key(doc))
                rows.append(suite_row(dataset, doc, cut, bucket=bucket, prompt_tokens=tokens))
            name = f"{stem}_{bucket // 1024}k.jsonl"
            suite[name] = rows
            manifest["files"][name] = {"rows": len(rows), "prompt_tokens": [r["prompt_tokens"] for r in rows],
                                       "documents": [f"{r['source']}:{r['path']}" for r in rows]}  # fmt: skip
            if len(rows) < per_bucket:
                manifest["shortfalls"][name] = (
                    f"{len(rows)} of {per_bucket}: too few held-out documents that long"
                )
    if not any(suite.values()):  # was an empty suite and exit 0: the eval failed on it later
        raise ValueError(
            f"{corpus / 'heldout.jsonl'}: no held-out document ({len(docs)} read) fills any bucket "
            f"{sorted(buckets)}; build a larger corpus or use smaller --buckets"
        )
    claim_output_dir(out, "suite", what="--out")
    for name, rows in suite.items():
        with open(out / name, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    files = ",".join(str(out / name) for name in manifest["files"] if manifest["files"][name]["rows"])
    manifest["eval_command"] = (
        f"python -m longspec.eval data.name=[{files}] data.context_margin={gen_room} "
        f"max_new_tokens={min(gen_room, 512)} ..."
    )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def _main(argv: list[str] | None) -> int:
    p = ArgumentParser(prog="python -m data_prep.instruct_suite", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--corpus", type=Path, required=True, help="registry corpus dir (its heldout.jsonl is read)"
    )
    p.add_argument("--tokenizer", required=True, help="the target's tokenizer dir")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--buckets", default="2048,4096,8192", help="comma-separated prompt budgets in tokens")
    p.add_argument("--per-bucket", type=int, default=4, help="rows per task and bucket")
    p.add_argument("--gen-room", type=int, default=512, help="tokens of each bucket left for generation")
    p.add_argument(
        "--tasks", default=",".join(DEFAULT_TASKS), help=f"comma-separated, of {','.join(SUITE_TASKS)}"
    )
    args = p.parse_args(argv)
    buckets = [int(b) for b in args.buckets.split(",") if b.strip()]
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    manifest = build_suite(corpus=args.corpus, tokenizer=load_tokenizer(args.tokenizer), out=args.out,
                           buckets=buckets, per_bucket=args.per_bucket, gen_room=args.gen_room,
                           tasks=tasks)  # fmt: skip
    print(json.dumps({name: info["rows"] for name, info in manifest["files"].items()}))
    for name, why in manifest["shortfalls"].items():
        print(f"warning: {name}: {why}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from longspec.cli import run_cli  # one line on stderr and exit 2 for a user error, like every CLI here

    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
