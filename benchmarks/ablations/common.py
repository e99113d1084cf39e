"""Shared pieces of the CPU ablations (issue 5): steps that build data for the shipped code target, metrics
reading, result files. The runs go through the same CLIs and resumable runner as `python -m longspec.pipeline`."""

from __future__ import annotations

import json
import os
import sys

from longspec.data.manifest import manifest_path
from longspec.pipeline import Step, load_preset
from longspec.provenance import run_info

__all__ = ["BASE", "corpus_step", "prep_step", "read_metrics", "trailing_mean", "write_result"]

# The quickstart's CPU preset (longspec/configs/pipeline/cpu.yaml); each ablation sets its own loss (default: the
# paper's CE only) and compares the paper's own switches.
BASE = load_preset("cpu")
TARGET = BASE.target_dir()


def corpus_step(out: str, corpus: str | None) -> tuple[list[Step], str]:
    """Reuse a corpus (e.g. outputs/quickstart/corpus) or build one under OUT/corpus."""
    if corpus is not None:
        if not os.path.isfile(os.path.join(corpus, "train.jsonl")):
            raise FileNotFoundError(
                f"{corpus} has no train.jsonl (python -m data_prep.stdlib_corpus --out DIR)"
            )
        return [], os.path.abspath(corpus)
    corpus = os.path.join(os.path.abspath(out), "corpus")
    step = Step(
        name="corpus",
        cmd=[sys.executable, "-m", "data_prep.stdlib_corpus", "--out", corpus,
             "--lcc-max-context-chars", str(BASE.lcc_max_context_chars)],
        outputs=[os.path.join(corpus, "train.jsonl"), os.path.join(corpus, "heldout_lcc.jsonl")],
    )  # fmt: skip
    return [step], corpus


def prep_step(
    name: str, module: str, *, source: str, out: str, seq_len: int, max_rows: int, extra=()
) -> Step:
    """`python -m data_prep.<module>` over the corpus with the code target's tokenizer."""
    return Step(
        name=name,
        cmd=[sys.executable, "-m", f"data_prep.{module}", "--source", source, "--tokenizer", TARGET, "--out", out,
             "--seq-len", str(seq_len), "--max-rows", str(max_rows), "--overwrite", "--no-progress", *extra],
        outputs=[manifest_path(out)],
    )  # fmt: skip


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at each step: per-batch losses swing with the file a batch comes from."""
    return [
        sum(values[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window))
        for i in range(len(values))
    ]


def write_result(out: str, name: str, result: dict, table: str) -> str:
    """OUT/<name>.json (+ the printed table) with date, command and commit."""
    result = {
        **run_info(),
        **result,
        "table": table,
    }
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['date']} commit {result['commit']}\n{table}\n\nwrote {path}")
    return path
