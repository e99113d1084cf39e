"""Shared pieces of the ablations: the target and preset the runs use, steps that build their data, metrics
reading, result files. The runs go through the same CLIs and resumable runner as `python -m longspec.pipeline`.

By default the quickstart's CPU preset (configs/pipeline/cpu.yaml) and its shipped code target. On a GPU,
any HF target directory, e.g. SmolLM2-135M-Instruct converted from its GGUF:

    python -m longspec.convert_gguf SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smol
    python benchmarks/ablations/anchor_offset.py --preset smollm2 --target /tmp/smol \
        --corpus .cache_target/smollm2_e2e/corpus ...

(the preset then gives the process count, the anchor range and each stage's own training settings, e.g. its
precision)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from longspec.cli import UserError
from longspec.data.manifest import manifest_path
from longspec.pipeline import PipelineConfig, Step, load_preset
from longspec.provenance import run_info

__all__ = [
    "add_target_args",
    "corpus_file",
    "corpus_step",
    "prep_step",
    "read_metrics",
    "resolve_target",
    "trailing_mean",
    "write_result",
]


def add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        default="cpu",
        help="the pipeline preset whose run settings apply (default: cpu, the quickstart's)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="an HF target directory (default: the preset's own model dir; a GGUF preset needs one: convert it "
        "with python -m longspec.convert_gguf)",
    )


def resolve_target(args: argparse.Namespace, **changes) -> tuple[PipelineConfig, str]:
    """(the preset with `changes` and, given --target, that directory as its target; the target's directory)."""
    preset = load_preset(args.preset)
    if args.target is not None:
        target = os.path.abspath(args.target)
        if not os.path.isfile(os.path.join(target, "config.json")):
            raise UserError(f"--target {args.target}: not an HF model directory (no config.json)")
        changes.update(target_path=target, target_gguf=None)
    preset = dataclasses.replace(preset, **changes)
    target = preset.target_dir()
    if target is None:
        raise UserError(
            f"preset {args.preset} names a GGUF: convert it (python -m longspec.convert_gguf SRC OUT) and pass "
            "--target OUT"
        )
    return preset, target


def corpus_file(corpus: str, name: str) -> str:
    """CORPUS/NAME.jsonl, or NAME.jsonl.gz (a prepared bundle's corpus)."""
    for candidate in (f"{name}.jsonl", f"{name}.jsonl.gz"):
        path = os.path.join(corpus, candidate)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{corpus} has no {name}.jsonl(.gz) (python -m data_prep.stdlib_corpus --out DIR)"
    )


def corpus_step(out: str, corpus: str | None) -> tuple[list[Step], str]:
    """Reuse a corpus (e.g. outputs/quickstart/corpus) or build one under OUT/corpus."""
    if corpus is not None:
        corpus_file(corpus, "train")  # fails here, before any step runs
        return [], os.path.abspath(corpus)
    corpus = os.path.join(os.path.abspath(out), "corpus")
    step = Step(
        name="corpus",
        cmd=[sys.executable, "-m", "data_prep.stdlib_corpus", "--out", corpus,
             "--lcc-max-context-chars", str(load_preset("cpu").lcc_max_context_chars)],
        outputs=[os.path.join(corpus, "train.jsonl"), os.path.join(corpus, "heldout_lcc.jsonl")],
    )  # fmt: skip
    return [step], corpus


def prep_step(
    name: str, module: str, *, source: str, tokenizer: str, out: str, seq_len: int, max_rows: int, extra=()
) -> Step:
    """`python -m data_prep.<module>` over the corpus with the target's tokenizer."""
    return Step(
        name=name,
        cmd=[sys.executable, "-m", f"data_prep.{module}", "--source", source, "--tokenizer", tokenizer, "--out", out,
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
