"""τ and speedups of several pipeline runs side by side, pooled over the samples every run keeps.

    python benchmarks/compare_runs.py K8K=runs/a K32K=runs/b [--evals t0_full_tree t1_graphs ...]

Each RUN is a pipeline output folder (`python -m longspec.pipeline --out RUN`) or one holding its `eval_*` folders
(a `launch/gpu_e2e.sh` log archive, unpacked). Per evaluation, a sample counts only where the quality guard keeps it
in every run (at T = 0 the target's greedy output is the same in each; at T > 0 each run samples its own), so the
runs are compared on the same prompts: the figures are the eval's own (`longspec.eval.summary.summarise`) over
those samples, every dataset of the evaluation pooled. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from longspec.eval.summary import sample_quality, summarise

POOLED = "all"


def load_eval(run: Path, name: str) -> dict | None:
    path = run / f"eval_{name}" / "results.json"
    return json.loads(path.read_text()) if path.is_file() else None


def kept_ids(results: dict) -> set[str]:
    """The samples the quality guard keeps in one evaluation (every dataset)."""
    methods = results["methods"]
    datasets = {d for per_dataset in methods.values() for d in per_dataset}
    kept = set()
    for dataset in datasets:
        kept |= {i for i, q in sample_quality(methods, dataset).items() if not q["degenerate"]}
    return kept


def pooled(results: dict, ids: set[str]) -> dict[str, dict]:
    """summary[method] over `ids`, every dataset as one."""
    methods = {
        m: {POOLED: [r for recs in per_dataset.values() for r in recs if r["id"] in ids]}
        for m, per_dataset in results["methods"].items()
    }
    greedy = results["config"]["generation"]["temperature"] == 0
    return summarise(methods, greedy=greedy)[POOLED]


def compare(runs: dict[str, Path], evals: list[str], baseline: str = "ar") -> list[dict]:
    rows = []
    for name in evals:
        results = {label: load_eval(path, name) for label, path in runs.items()}
        if any(r is None for r in results.values()):
            continue
        common = set.intersection(*(kept_ids(r) for r in results.values()))
        row = {"eval": name, "samples": len(common), "runs": {}}
        for label, r in results.items():
            summary = pooled(r, common) if common else {}
            spec = summary.get("longspec", {})
            row["runs"][label] = {
                "tau": spec.get("mean_accept_length", math.nan),
                "speedup": spec.get("speedup", {}).get(baseline, math.nan),
            }
        rows.append(row)
    return rows


def markdown(rows: list[dict], labels: list[str], baseline: str = "ar") -> str:
    head = (
        ["evaluation (samples)"]
        + [f"τ, {run}" for run in labels]
        + [f"vs {baseline}, {run}" for run in labels]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(value: float, suffix: str = "") -> str:
        return "–" if value is None or math.isnan(value) else f"{value:.2f}{suffix}"

    for row in rows:
        taus = [cell(row["runs"][run]["tau"]) for run in labels]
        speeds = [cell(row["runs"][run]["speedup"], "x") for run in labels]
        lines.append(f"| {row['eval']} ({row['samples']}) | " + " | ".join(taus + speeds) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN", help="a label and a pipeline output folder")
    parser.add_argument(
        "--evals",
        nargs="+",
        default=["t0_full_tree", "t1_full_tree", "t0_graphs", "t1_graphs", "t0_fp32"],
        help="evaluation names (the folders eval_NAME)",
    )
    parser.add_argument("--baseline", default="ar", help="the target-only method speedups are quoted against")
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not Path(path).is_dir():
            parser.error(f"expected LABEL=FOLDER with an existing folder, got {spec!r}")
        runs[label] = Path(path)
    rows = compare(runs, args.evals, args.baseline)
    if not rows:
        raise SystemExit(f"no evaluation of {args.evals} is in every run")
    table = markdown(rows, list(runs), args.baseline)
    print(table)
    return table


if __name__ == "__main__":
    main()
