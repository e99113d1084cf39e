"""The pipeline's report: evaluation rows and table, the training summary and loss plot, OUT/report.md and
OUT/e2e_summary.json."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time

from longspec.eval.divergence import TIE_ULPS
from longspec.eval.summary import BASELINES, MAX_TIMING_SPREAD, identical_text, policy_view, unstable_note
from longspec.pipeline.plan import Step
from longspec.pipeline.presets import PipelineConfig
from longspec.pipeline.runner import RunRecord
from longspec.provenance import git_commit

__all__ = [
    "eval_rows",
    "fmt",
    "lossless_check",
    "plot_training",
    "results_table",
    "training_summary",
    "write_report",
]


def eval_rows(out: str, preset: PipelineConfig) -> list[dict]:
    """One row per (eval run, dataset, method) from the eval's results.json files."""
    rows = []
    for ev in preset.evals:
        path = os.path.join(out, f"eval_{ev.name}" if ev.name else "eval", "results.json")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            results = json.load(f)
        summary = results["summary"]
        max_spread = results.get("config", {}).get("max_timing_spread", MAX_TIMING_SPREAD)
        for dataset, per_method in summary.items():
            # The headline excludes samples whose target output is degenerate; when none is left, the figures
            # over all samples are shown, marked (they measure the target's loop, not the drafter).
            all_degenerate = all(not s.get("num_samples") for s in per_method.values())
            figures = {m: (s.get("all_samples") or s) if all_degenerate else s for m, s in per_method.items()}
            # A batched method's rate is its batch's throughput (every row shares the batch's decode time, so a
            # row's own tokens / that time says how long the row was, not how fast the batch ran).
            rate = {m: f.get("batch_tokens_per_s") or f.get("tokens_per_s") for m, f in figures.items()}
            # a method with a sample whose interleaved runs spread past the eval's limit: no speedup from it
            unstable = {m for m, f in figures.items() if f.get("unstable_samples")}
            for method, s in per_method.items():
                f = figures[method]
                bases = [
                    base
                    for base in BASELINES
                    if base != method
                    and base in figures
                    and (rate[base] or 0) > 0
                    and rate[method] is not None
                ]
                unstable_vs = [b for b in bases if {method, b} & unstable]
                speedup = {b: rate[method] / rate[b] for b in bases if b not in unstable_vs}
                rows.append({
                    "run": ev.name or "eval", "temperature": ev.temperature, "dataset": dataset, "method": method,
                    "tau": f.get("mean_accept_length"), "tokens_per_s": rate[method],
                    "speedup": speedup, "unstable_vs": unstable_vs, "identical": s.get("identical_to_greedy"),
                    "max_timing_spread": max_spread,
                    "identical_text": identical_text(s), "unexplained": s.get("unexplained_divergences"),
                    "prompt_len": f.get("mean_prompt_len"), "num_samples": s.get("num_samples"),
                    "num_degenerate": s.get("num_degenerate", 0), "degenerate_figures": all_degenerate,
                    "trees": f.get("trees") or {}, "policy": f.get("policy") or {},
                })  # fmt: skip
    return rows


TARGET_ONLY = ("ar", "vanilla_hf", "vanilla_fa", "hf_compile")  # what "plain decoding" means in a report


def fmt(value, spec: str) -> str:
    """A number for a table cell; "–" when there is none."""
    return "–" if value is None else format(value, spec)


def lossless_check(rows: list[dict]) -> bool:
    """The run's lossless verdict over its greedy rows (`eval_rows`), printed: False when an output leaves the
    target's greedy output where its two tokens are not a near-tie and the target's argmax there is not the
    output's token (longspec.eval.divergence). The failing rows are listed with how far past
    the tolerance they are (in ulps of the top logit: a few read as rounding past the margin, thousands as a
    logic error)."""
    greedy = [r for r in rows if r["temperature"] == 0 and r["identical"] is not None]
    if failing := [r for r in greedy if r["unexplained"]]:
        print("LOSSLESS CHECK FAILED: an output differs from the target's greedy output where the target's two "
              "tokens are not a numerical near-tie:", file=sys.stderr)  # fmt: skip
        for r in failing:
            print(f"  {r['run']} / {r['dataset']} / {r['method']}: {r['identical_text']}", file=sys.stderr)
        return False
    if any(r["identical"] != 1 for r in greedy):
        print("lossless check passed: every greedy output equals the reference, or leaves it only at a near-tie "
              f"of the target's logits (<= {TIE_ULPS:g} ulp in its dtype) or where the reference itself left the "
              "target's argmax (see the eval logs)")  # fmt: skip
    return True


def results_table(rows: list[dict]) -> str:
    """Markdown table: τ, tokens/s, speedup vs each baseline, identical to the target's greedy output."""
    baselines = [
        b for b in ("vanilla_hf", "vanilla_fa", "ar")
        if any(b in r["speedup"] or b in r.get("unstable_vs", ()) for r in rows)
    ]  # fmt: skip
    head = ["run", "T", "dataset", "prompt tokens", "method", "samples", "τ", "tokens/s"]
    head += [f"speedup vs {b}" for b in baselines] + ["identical to greedy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mark = "*" if r.get("degenerate_figures") else ""
        samples = f"{r['num_samples'] or 0}" + (
            f" (+{r['num_degenerate']} degenerate)" if r.get("num_degenerate") else ""
        )
        cells = [r["run"], f"{r['temperature']:g}", r["dataset"], fmt(r["prompt_len"], ".0f"), r["method"], samples,
                 fmt(r["tau"], ".2f") + mark, fmt(r["tokens_per_s"], ".1f") + mark]  # fmt: skip
        cells += [
            "unstable" if b in r.get("unstable_vs", ())
            else fmt(r["speedup"].get(b), ".2f") + ("x" if b in r["speedup"] else "") + mark
            for b in baselines
        ]  # fmt: skip
        cells.append(r["identical_text"])
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:  # a slower longspec says why, in one line
        if r["method"] != "longspec" or r["tokens_per_s"] is None or not r.get("trees"):
            continue
        others = [o for o in rows if o["run"] == r["run"] and o["dataset"] == r["dataset"]
                  and o["method"] in TARGET_ONLY and o["tokens_per_s"] is not None]  # fmt: skip
        best = max(others, key=lambda o: o["tokens_per_s"], default=None)
        unstable = best is not None and best["method"] in r.get("unstable_vs", ())  # no ratio from that
        if best is not None and not unstable and r["tokens_per_s"] < best["tokens_per_s"]:
            lines.append("")
            lines.append(f"{r['run']} / {r['dataset']}: {_why_slower(r, best)}")
    if unstable := [r for r in rows if r.get("unstable_vs")]:
        lines += ["", unstable_note(max(r["max_timing_spread"] for r in unstable))]
    if any(r.get("degenerate_figures") for r in rows):
        lines.append("")
        lines.append(
            "\\* every sample of that dataset is degenerate (the target's own output loops: see the eval's "
            "report.md, Output quality): figures over all samples, which measure the loop, not the drafter."
        )
    return "\n".join(lines)


def _why_slower(r: dict, best: dict) -> str:
    """One line on why longspec ran slower than the best target-only method in that cell."""
    trees = r["trees"]
    plain = trees.get("ar", 0) / max(sum(trees.values()), 1)
    head = f"longspec at {r['tokens_per_s'] / best['tokens_per_s']:.2f}x of {best['method']}: "
    if plain >= 0.5:
        view = policy_view(r.get("policy") or {})
        return head + (
            f"tree=auto judged speculation not worth its round cost here and decoded without it in {plain:.0%} "
            "of rounds; the rest: rounds it speculated to learn (exploration, a call's first rounds) and "
            "run-to-run timing variation."
            + (f" At the last sample's end the policy rated {view}." if view else "")
        )
    return head + (
        f"speculation ran in {1 - plain:.0%} of rounds ({', '.join(sorted(trees))}) and τ {r['tau']:.2f} did not "
        "pay for its rounds' cost (with tree=auto: acceptance learned on earlier samples carried over to samples "
        "the drafter predicts worse, and a short sample ends before the estimate catches up)."
    )


def training_summary(out: str) -> list[dict]:
    summary = []
    for index in (1, 2, 3):
        path = os.path.join(out, "runs", f"stage{index}", "metrics.jsonl")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        if records:
            tail = records[-max(1, len(records) // 10) :]  # mean of the last 10%: one step is noisy
            summary.append({
                "stage": index, "steps": records[-1]["step"], "tokens": records[-1].get("tokens_seen"),
                "first_loss": _ce(records[0]), "final_loss": sum(map(_ce, tail)) / len(tail),
                "final_acc": sum(r.get("acc", 0.0) for r in tail) / len(tail), "records": records,
            })  # fmt: skip
    return summary


def _ce(record: dict) -> float:
    """The data cross-entropy of a metrics.jsonl record (`loss` adds the KL term when distillation is on)."""
    return record.get("ce", record["loss"])


def plot_training(summary: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    offset = 0
    for s in summary:
        steps = [offset + r["step"] for r in s["records"]]
        ax.plot(steps, [_ce(r) for r in s["records"]], label=f"stage {s['stage']}")
        offset = steps[-1]
    ax.set_xlabel("optimizer step (stages chained)")
    ax.set_ylabel("drafter cross-entropy on the data (nats)")
    ax.set_title("drafter training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(
    out: str, preset: PipelineConfig, steps: list[Step], statuses: dict[str, str], wall_s: float
) -> str:
    run_record = RunRecord(out)
    rows = eval_rows(out, preset)
    summary = training_summary(out)
    has_plot = bool(summary) and plot_training(summary, os.path.join(out, "training_loss.png"))
    lines = [
        f"# longspec end to end: preset `{preset.name}`",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; commit `{git_commit()}`; "
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"- command: `python -m longspec.pipeline --preset {preset.name} --out {out}`; this invocation: {wall_s:.0f} s; "
        f"all steps (incl. ones done by earlier invocations): {sum(run_record.seconds(s.name) or 0 for s in steps):.0f} s",
        "",
        "## Evaluation (held-out code completion)",
        "",
        results_table(rows) if rows else "(no evaluation results)",
        "",
        "τ = tokens emitted per target forward; tokens/s exclude prefill; speedups are measured in the same run.",
        "",
        "## Drafter training",
        "",
        "| stage | steps | tokens | first CE | final CE (last 10% of steps) | final top-1 on the data |",
        "|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(f"| {s['stage']} | {s['steps']} | {s['tokens']} | {s['first_loss']:.3f} | "
                     f"{s['final_loss']:.3f} | {s['final_acc']:.1%} |")  # fmt: skip
    if has_plot:
        lines += ["", "![training loss](training_loss.png)"]
    for ev in preset.evals:
        sub = f"eval_{ev.name}" if ev.name else "eval"
        for png in sorted(p for p in os.listdir(os.path.join(out, sub)) if p.endswith(".png")) \
                if os.path.isdir(os.path.join(out, sub)) else []:  # fmt: skip
            lines += ["", f"![{sub}/{png}]({sub}/{png})"]
    lines += ["", "## Steps", "", "| step | status | seconds | command |", "|---|---|---|---|"]
    for step in steps:
        seconds = run_record.seconds(step.name)
        command = step.command.replace("|", "\\|")  # a pipe would end the table cell
        lines.append(
            f"| {step.name} | {statuses.get(step.name, '–')} | {fmt(seconds, '.1f')} | `{command}` |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "e2e_summary.json"), "w") as f:
        json.dump({"preset": dataclasses.asdict(preset), "eval": rows, "wall_s": wall_s,
                   "training": [{k: v for k, v in s.items() if k != "records"} for s in summary]}, f, indent=1)  # fmt: skip
    return text
