"""Stage-3 prompts: long-context instructions cut from TRAIN-split corpus documents (issue 9).

    python -m data_prep.instruct_prompts --corpus DIR --out prompts.jsonl --tokenizer T \
        [--max-prompt-tokens 6144] [--min-prompt-tokens 1024] [--num-prompts 256]

Rows in the schema data_prep.stage3_regenerate reads: {"id", "context", "prompt", "task", "source", "path"}; the
target then writes each response itself. The three tasks take turns (data_prep.doc_tasks): "complete this code"
(a Python file cut at a line end), "summarise this document", "answer a question about this document" (a
section / class / function of the document, named in the question). Each prompt's length -- the chat-templated
user turn exactly as stage3_regenerate renders it -- is drawn per document between the two bounds, so the drafter
sees every context length up to the maximum. Documents come in a stable hash order; held-out files are never read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from data_prep.common import load_tokenizer
from data_prep.doc_tasks import CODE_INSTRUCTION, TASKS, cut_task, doc_key, ordered
from data_prep.instruct_suite import read_rows
from data_prep.stage3_sft import render_prompt
from data_prep.stdlib_corpus import path_fraction
from longspec.cli import ArgumentParser
from longspec.ownership import claim_output_file


def build_prompts(*, corpus: Path, tokenizer, out: Path, max_prompt_tokens: int = 6144,
                  min_prompt_tokens: int = 1024, num_prompts: int = 256) -> dict:  # fmt: skip
    if not 0 < min_prompt_tokens <= max_prompt_tokens or num_prompts < 1:
        raise ValueError("need 0 < min_prompt_tokens <= max_prompt_tokens and num_prompts >= 1")
    claim_output_file(out, "instruct-prompts")
    docs = ordered(read_rows(corpus / "train.jsonl"), salt="stage3-prompts")

    def count(context: str, instruction: str) -> int:
        content = f"{context}\n\n{instruction or CODE_INSTRUCTION}"
        return len(tokenizer(render_prompt(tokenizer, content), add_special_tokens=False)["input_ids"])

    cursor = {task: 0 for task in TASKS}  # each task walks the same order on its own; a document serves once
    used: set[str] = set()
    counts = {task: 0 for task in TASKS}
    lengths = []
    with open(out, "w", encoding="utf-8") as f:
        for i in range(num_prompts):
            task = TASKS[i % len(TASKS)]
            while cursor[task] < len(docs):
                doc = docs[cursor[task]]
                cursor[task] += 1
                key = doc_key(doc)
                # ~2 characters a token at the densest: a shorter text cannot reach the minimum.
                if key in used or len(doc["text"]) < 2 * min_prompt_tokens:
                    continue
                span = max_prompt_tokens - min_prompt_tokens
                budget = min_prompt_tokens + int(path_fraction(key, salt="stage3-length") * span)
                cut = cut_task(task, doc, count, budget)
                if cut is None or (tokens := count(cut["context"], cut["instruction"])) < min_prompt_tokens:
                    continue
                used.add(key)
                counts[task] += 1
                lengths.append(tokens)
                row = {"id": f"{task}:{key}", "context": cut["context"],
                       "prompt": cut["instruction"] or CODE_INSTRUCTION, "task": task,
                       "source": doc["source"], "path": doc["path"], "prompt_tokens": tokens}  # fmt: skip
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                break
    if not lengths:
        raise ValueError(f"{corpus}/train.jsonl has no document of >= {min_prompt_tokens} prompt tokens")
    return {"prompts": len(lengths), "per_task": counts, "min_tokens": min(lengths), "max_tokens": max(lengths),
            "mean_tokens": sum(lengths) / len(lengths)}  # fmt: skip


def _main(argv: list[str] | None) -> int:
    p = ArgumentParser(prog="python -m data_prep.instruct_prompts", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="registry corpus dir (its train.jsonl is read)")
    p.add_argument("--out", type=Path, required=True, help="output .jsonl of prompt rows")
    p.add_argument("--tokenizer", required=True, help="the target's tokenizer dir (with its chat template)")
    p.add_argument("--max-prompt-tokens", type=int, default=6144)
    p.add_argument("--min-prompt-tokens", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=256)
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {args.tokenizer!r} has no chat template: stage-3 prompts are chat turns")
    summary = build_prompts(corpus=args.corpus, tokenizer=tokenizer, out=args.out,
                            max_prompt_tokens=args.max_prompt_tokens, min_prompt_tokens=args.min_prompt_tokens,
                            num_prompts=args.num_prompts)  # fmt: skip
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    from longspec.cli import run_cli  # one line on stderr and exit 2 for a user error, like every CLI here

    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
