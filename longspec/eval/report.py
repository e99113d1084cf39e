"""report.md in the paper's Table 1 layout (τ / tokens/s / speedup per dataset and method), plus the plots, from
an evaluation's summary (`longspec.eval.summary`); `python -m longspec.eval.report RESULTS.json` re-summarises a
recorded run with the current rules."""

from __future__ import annotations

import math
import os

from longspec.atomic import write_text_atomic
from longspec.eval.quality import MIN_DISTINCT_RATIO
from longspec.eval.summary import (
    BASELINES,
    MAX_TIMING_SPREAD,
    identical_text,
    policy_view,
    recorded_generation,
    sample_quality,
    summarise,
    timing_spread,
    unstable_note,
)

__all__ = ["outputs_markdown", "read_results", "report_markdown", "rescore", "write_report"]


def _fmt(x: float, spec: str) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def report_markdown(results: dict) -> str:
    summary = results["summary"]
    datasets = list(summary)
    methods = list(results["methods"])
    main_base = next((b for b in BASELINES if any(b in summary[d] for d in datasets)), None)
    cfg = results["config"]
    generation = recorded_generation(cfg)
    lines = [
        "# LongSpec evaluation",
        "",
        f"target `{cfg['target']['path']}` · device {results['device']} · {results['dtype']} · "
        f"temperature {generation['temperature']} · max_new_tokens {generation['max_new_tokens']} · started "
        f"{results['started']}" + (f" · commit {results['commit']}" if results.get("commit") else ""),
        "",
    ]
    if results.get("resumed"):
        lines += [
            f"Continued from a stopped run of this configuration: {sum(results['resumed'].values())} sample(s) "
            f"read back ({', '.join(f'{d} {n}' for d, n in results['resumed'].items())}); their times were "
            "measured by that run.",
            "",
        ]
    lines += [
        f"τ = mean acceptance length (tokens per target forward); tokens/s exclude the prefill; speedup is vs "
        f"`{main_base}` measured in this run. Samples whose target output is degenerate are excluded (see "
        f"Output quality)."
        if main_base
        else "τ = mean acceptance length; tokens/s exclude prefill.",
        "",
    ]
    header = "| method | " + " | ".join(f"{d} τ | {d} tok/s | {d} speedup" for d in datasets) + " |"
    lines += [header, "|" + "---|" * (1 + 3 * len(datasets))]
    for method in methods:
        cells = []
        for d in datasets:
            agg = summary[d].get(method)
            if agg is None:
                cells += ["–"] * 3
                continue
            speedup = 1.0 if method == main_base else agg["speedup"].get(main_base, math.nan)
            unstable = main_base in agg.get("unstable_vs", ())
            cells += [
                _fmt(agg["mean_accept_length"], ".2f"),
                _fmt(agg["tokens_per_s"], ".1f"),
                "unstable" if unstable else _fmt(speedup, ".2f") + "x",
            ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")

    if any(agg.get("unstable_vs") for d in datasets for agg in summary[d].values()):
        spread = results["config"].get("max_timing_spread", MAX_TIMING_SPREAD)
        lines += ["", unstable_note(spread) + " See Timing below."]
    lines += ["", "## Details per dataset", ""]
    lines += [
        "| dataset | method | samples | mean prompt | rounds | ms / round | draft / verify / overhead | speedups "
        "| identical to greedy |"
    ]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    for d in datasets:
        for method, agg in summary[d].items():
            split = agg["time_split"]
            split_txt = " / ".join(
                _fmt(split[k] * 100, ".0f") + "%" for k in ("draft_s", "verify_s", "overhead_s")
            )
            speedups = [f"{_fmt(v, '.2f')}x vs {b}" for b, v in agg["speedup"].items()]
            speedups = ", ".join(speedups + [f"unstable vs {b}" for b in agg.get("unstable_vs", ())]) or "–"
            ident_txt = identical_text(agg)
            if agg["identical_to_greedy"] is not None:
                ident_txt += f" (vs {agg['greedy_reference']})"
            lines.append(
                f"| {d} | {method} | {agg['num_samples']} | {agg['mean_prompt_len']:.0f} | {agg['rounds']} | "
                f"{_fmt(agg['ms_per_round'], '.1f')} | "
                f"{split_txt} | {speedups} | {ident_txt} |"
            )
    tree_rows = [(d, m, agg["trees"]) for d in datasets for m, agg in summary[d].items() if agg.get("trees")]
    if tree_rows:
        lines += [
            "",
            "## Trees run (share of rounds; ar = no speculation, lookupK = a prompt-lookup chain of K drafts, lookupKxB "
            "= a forest of B such chains) and the drafter trees' acceptance per depth d (P(d accepted | d-1 was))",
            "",
        ]
        for d, method, trees in tree_rows:
            total = sum(trees.values())
            shares = sorted(trees.items(), key=lambda kv: -kv[1])
            profile = summary[d][method].get("acceptance_profile") or []
            profile_txt = ",".join("–" if p is None else f"{p:.2f}" for p in profile)
            view = policy_view(summary[d][method].get("policy") or {})
            lines.append(
                f"- {d} / {method}: "
                + ", ".join(f"`{t}` {100 * c / total:.0f}%" for t, c in shares)
                + (f"; acceptance per depth `{profile_txt}`" if profile else "")
                + (f"; the policy's view at the end: {view}" if view else "")
            )
    lines += batch_markdown(summary, cfg.get("batch_size", 1))
    lines += round_costs_markdown(results)
    lines += timing_markdown(results)
    lines += quality_markdown(summary)
    skipped = [r for r in results["data"] if r["num_malformed"] or r["num_filtered_by_length"]]
    if skipped:
        lines += ["", "## Data", ""]
        for r in skipped:
            lines.append(
                f"- `{r['source']}`: {r['num_rows']} rows, {r['num_kept']} kept, "
                f"{r['num_filtered_by_length']} outside the length filter, {r['num_malformed']} malformed"
                + (
                    f" (first: line {r['malformed'][0]['line']}: {r['malformed'][0]['reason']})"
                    if r["malformed"]
                    else ""
                )
            )
    plots = results.get("plots", [])
    if plots:
        lines += ["", "## Plots", ""] + [f"![{os.path.splitext(p)[0]}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def batch_markdown(summary: dict, batch_size: int) -> list[str]:
    """batch_size > 1: each method's throughput (all tokens of a batch over its decode wall time) beside its
    tokens/s per sequence; the speedups above compare these throughputs."""
    if batch_size <= 1:
        return []
    lines = [
        "",
        f"## Batch throughput (batch_size {batch_size})",
        "",
        "The engine methods (longspec, ar, pld) and the HF baselines vanilla_hf / vanilla_fa decoded the samples "
        f"{batch_size} at a time (a dataset's last batch may be smaller); hf_compile one at a time. tok/s above "
        "is per sequence (a sample's tokens over "
        "its batch's decode time); the speedups compare throughputs: batch tok/s for the batched methods, "
        "tok/s for the others.",
        "",
        "| dataset | method | batch tok/s | tok/s per sequence |",
        "|---|---|---|---|",
    ]
    for d, per_method in summary.items():
        for method, agg in per_method.items():
            batch = _fmt(agg["batch_tokens_per_s"], ".1f") if "batch_tokens_per_s" in agg else "– (batch 1)"
            lines.append(f"| {d} | {method} | {batch} | {_fmt(agg['tokens_per_s'], '.1f')} |")
    return lines


def round_costs_markdown(results: dict) -> list[str]:
    """tree=auto's measured round costs (results' `round_costs_s`, "bucket:name" -> seconds) per context bucket:
    a plain step, the chain of one (one draft step and a verify of two tokens) and the largest drafter tree, each
    also in plain steps: what drafting costs on this device, and what a draft vocabulary saves."""
    costs = results.get("round_costs_s") or {}
    buckets: dict[int, dict[str, float]] = {}
    for key, seconds in costs.items():
        bucket, name = key.split(":", 1)
        buckets.setdefault(int(bucket), {})[name] = seconds
    rows = [(b, named) for b, named in sorted(buckets.items()) if "ar" in named and "1" in named]
    if not rows:
        return []
    vocab = results.get("draft_vocab") or {}
    head = (
        f"the drafter drafts over {vocab['size']:,} of the target's {vocab['target_vocab']:,} ids"
        if vocab and vocab["size"] < vocab["target_vocab"]
        else "the drafter drafts over the target's whole vocabulary"
    )
    lines = [
        "",
        f"## Round costs (measured before decoding; {head})",
        "",
        "| context | plain step ms | chain of one ms | in plain steps | largest tree | its ms | in plain steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for bucket, named in rows:
        plain, chain = named["ar"], named["1"]
        trees = [n for n in named if n[0].isdigit()]  # drafter trees: level widths joined by '-'
        largest = max(trees, key=lambda n: sum(map(int, n.split("-"))))
        lines.append(
            f"| {bucket} | {1e3 * plain:.3f} | {1e3 * chain:.3f} | {chain / plain:.2f} | `{largest}` | "
            f"{1e3 * named[largest]:.3f} | {named[largest] / plain:.2f} |"
        )
    return lines


def timing_markdown(results: dict) -> list[str]:
    """With timing_repeats > 1: how far a sample's interleaved runs spread (max / min - 1 of decode time), per
    method: the run-to-run variation the fastest-run figures above leave out, to read small speedups against."""
    repeats = results["config"].get("timing_repeats", 1)
    if repeats <= 1:
        return []
    limit = results["config"].get("max_timing_spread", MAX_TIMING_SPREAD)
    lines = ["", f"## Timing ({repeats} interleaved runs per sample, the fastest kept)", ""]
    for method, per_dataset in results["methods"].items():
        spreads = sorted(
            spread - 1
            for records in per_dataset.values()
            for record in records
            if (spread := timing_spread(record)) is not None
        )
        if spreads:
            median = spreads[len(spreads) // 2]
            lines.append(
                f"- {method}: a sample's runs spread by {100 * median:.0f}% (median), {100 * spreads[-1]:.0f}% "
                f"(most), over {len(spreads)} samples; {sum(s + 1 > limit for s in spreads)} beyond the {limit:g}x "
                "limit (unstable)"
            )
    return lines


def quality_markdown(summary: dict) -> list[str]:
    """The quality guard's section: per dataset the distinct-token ratios of the target's reference outputs, the
    degenerate samples (left out of the tables above) and the τ they would have reported."""
    lines = ["", "## Output quality (target reference)", ""]
    lines += [
        f"Distinct-token ratio = distinct tokens / tokens of the target's own output per sample. A sample is "
        f"degenerate (ratio < {MIN_DISTINCT_RATIO}, or its tail one short n-gram looping) and left out of every "
        f"τ / tok/s / speedup above; its figures are listed here apart.",
        "",
        "| dataset | samples | degenerate | distinct ratio min / median / max | τ on degenerate samples |",
        "|---|---|---|---|---|",
    ]
    for dataset, per_method in summary.items():
        first = next(iter(per_method.values()))
        quality = first["quality"]
        ratios = sorted(q["distinct_ratio"] for q in quality.values() if q["distinct_ratio"] is not None)
        spread = (
            " / ".join(format(x, ".2f") for x in (ratios[0], ratios[len(ratios) // 2], ratios[-1]))
            if ratios
            else "–"
        )
        flagged = sorted(i for i, q in quality.items() if q["degenerate"])
        tau_apart = ", ".join(
            f"{m} {_fmt(agg['degenerate_samples']['mean_accept_length'], '.2f')}"
            for m, agg in per_method.items()
            if agg["degenerate_samples"] is not None
        )
        ids = f" ({', '.join(flagged[:8])}{', ...' if len(flagged) > 8 else ''})" if flagged else ""
        lines.append(f"| {dataset} | {len(quality)} | {len(flagged)}{ids} | {spread} | {tau_apart or '–'} |")
    return lines


def write_report(results: dict, output_dir: str) -> None:
    """report.md + PNG plots in output_dir."""
    from longspec.eval.plots import plot_by_context_length

    results["plots"] = plot_by_context_length(results["methods"], output_dir)
    write_text_atomic(os.path.join(output_dir, "report.md"), report_markdown(results))


def read_results(results_path: str) -> dict:
    """A results.json written by `python -m longspec.eval`, checked to be one."""
    import json

    with open(results_path, encoding="utf-8") as f:
        results = json.load(f)
    if not isinstance(results, dict) or "methods" not in results or "config" not in results:
        raise ValueError(f"{results_path} is not a longspec.eval results.json (no methods / config)")
    return results


def rescore(results_path: str, output_dir: str | None = None, results: dict | None = None) -> dict:
    """Summarise an existing results.json again with this version's rules (quality guard, speedup baselines,
    the divergences' verdicts) and rewrite its summary, report.md and plots: a recorded run is re-read, never
    re-measured. `results`: the file's content when the caller has read (and changed) it already."""
    import json

    results = read_results(results_path) if results is None else results
    output_dir = output_dir or os.path.dirname(os.path.abspath(results_path))
    os.makedirs(output_dir, exist_ok=True)
    config = results["config"]
    results["summary"] = summarise(
        results["methods"],
        greedy=recorded_generation(config).get("temperature", 0) == 0,
        max_spread=config.get("max_timing_spread", MAX_TIMING_SPREAD),
    )
    write_text_atomic(os.path.join(output_dir, "results.json"), json.dumps(results, indent=1))
    write_report(results, output_dir)
    return results


def outputs_markdown(methods: dict[str, dict[str, list[dict]]], decode, max_chars: int = 600) -> str:
    """What the target wrote, per sample: its reference output (as `sample_quality` picks it) decoded with
    `decode(ids) -> str`, cut at `max_chars`, with the quality guard's verdict. A τ is only worth quoting on
    text like this; a loop shows at a glance."""
    lines = ["# Target outputs", ""]
    for dataset in sorted({d for per in methods.values() for d in per}):
        for sample_id, q in sample_quality(methods, dataset).items():
            record = next(r for r in methods[q["judged_on"]][dataset] if r["id"] == sample_id)
            ratio = "–" if q["distinct_ratio"] is None else f"{q['distinct_ratio']:.2f}"
            verdict = f"degenerate: {q['reason']}" if q["reason"] else "ok"
            text = decode(record["output_ids"])
            cut = text[:max_chars] + (" [...]" if len(text) > max_chars else "")
            fence = "`" * 3
            while fence in cut:  # a fence longer than any backtick run inside (code outputs have them)
                fence += "`"
            lines += [
                f"## {dataset} / {sample_id}",
                "",
                f"{q['judged_on']}, {len(record['output_ids'])} tokens, distinct ratio {ratio}, {verdict}",
                "",
                fence + "text",
                cut,
                fence,
                "",
            ]
    return "\n".join(lines)


def _main(argv: list[str] | None) -> None:
    from longspec.cli import ArgumentParser

    parser = ArgumentParser(
        description="Re-summarise an eval results.json (quality guard, report.md, plots; with --reanalyse, "
        "its divergences first)."
    )
    parser.add_argument("results", help="a results.json written by python -m longspec.eval")
    parser.add_argument("--out", default=None, help="directory for the rewritten files (default: beside it)")
    parser.add_argument(
        "--show-outputs",
        metavar="TOKENIZER",
        default=None,
        help="also write outputs.md: the target's output per sample, decoded with this tokenizer (a model dir, "
        "a .gguf file or pkg://PACKAGE/FILE.gguf)",
    )
    parser.add_argument(
        "--reanalyse",
        metavar="TARGET",
        default=None,
        help="first run the divergence analysis again on every greedy output that differs from the reference, "
        "with this target (its directory, or with --gguf-file a GGUF): the recorded outputs, the current rule",
    )
    parser.add_argument(
        "--gguf-file", default=None, help="with --reanalyse: a GGUF file in TARGET (or a path)"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="with --reanalyse: the target's dtype (default: the evaluation's); float32 measures a bf16 flip's "
        "gap without bf16 rounding (near-ties are judged in the evaluation's dtype either way)",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="with --reanalyse: where the evaluation's JSONL files are now, by name",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="with --reanalyse: where the target runs (default cpu; e.g. cuda for a large target)",
    )
    args = parser.parse_args(argv)
    results = read_results(args.results)
    if args.reanalyse:
        from longspec.eval.reanalyse import reanalyse
        from longspec.target_source import (
            load_causal_lm,
            load_tokenizer,
            resolve_device,
            resolve_dtype,
            resolve_source,
        )

        source = resolve_source(args.reanalyse, args.gguf_file)
        dtype = resolve_dtype(args.dtype or results.get("dtype") or "float32", argument="--dtype")
        device = resolve_device(args.device, argument="--device")  # checked before any weight is read
        model = load_causal_lm(source, dtype=dtype, device_map=str(device)).eval()
        count = reanalyse(results, model, load_tokenizer(source), data_dir=args.data_dir)
        print(f"re-analysed {count} divergence(s) with the target in {dtype}")
    results = rescore(args.results, args.out, results)
    out = args.out or os.path.dirname(os.path.abspath(args.results))
    if args.show_outputs:
        from longspec.target_source import load_tokenizer

        tokenizer = load_tokenizer(args.show_outputs)
        text = outputs_markdown(
            results["methods"], lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        )
        write_text_atomic(os.path.join(out, "outputs.md"), text)
        print(os.path.join(out, "outputs.md"))
    print(os.path.join(out, "report.md"))


def main(argv: list[str] | None = None) -> int:
    from longspec.cli import run_cli

    return run_cli(_main, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
