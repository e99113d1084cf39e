"""Per-dataset summaries and report.md in the paper's Table 1 layout (τ / tokens/s / speedup per dataset and
method), plus the plots. Speedups are ratios of throughputs measured in the same run."""

from __future__ import annotations

import math
import os

from longspec.atomic import write_text_atomic
from longspec.eval.divergence import TIE_ULPS, explained, gap_ulps
from longspec.eval.quality import MIN_DISTINCT_RATIO, assess
from longspec.infer.stats import acceptance_profile

__all__ = [
    "BASELINES",
    "GREEDY_REFERENCES",
    "greedy_reference",
    "identical_text",
    "pooled_acceptance_profile",
    "sample_quality",
    "summarise",
    "write_report",
    "report_markdown",
]

# Methods a speedup can be quoted against, the paper's baseline (vanilla FlashAttention) first.
BASELINES = ("vanilla_fa", "vanilla_hf", "hf_compile", "ar", "pld")
# Target-only methods whose output IS the target's greedy output (the lossless reference at T = 0).
GREEDY_REFERENCES = ("ar", "vanilla_fa", "hf_compile", "vanilla_hf")


def pooled_acceptance_profile(records: list[dict]) -> list[float | None]:
    """Per depth d: P(depth d accepted | depths < d were) over the rounds of every record (their `depth_reached`
    / `depth_accepted` summed), None where no round reached d."""
    depth = max((len(r.get("depth_reached") or []) for r in records), default=0)
    reached, accepted = [0] * depth, [0] * depth
    for r in records:
        for d, (n, a) in enumerate(
            zip(r.get("depth_reached") or [], r.get("depth_accepted") or [], strict=True)
        ):
            reached[d] += n
            accepted[d] += a
    return acceptance_profile(reached, accepted)


def policy_view(policy: dict) -> str:
    """tree=auto's view at the end of a call (GenerationStats.policy), in one clause: plain decoding against its
    best speculating round, each in tokens per ms with what that rate is made of; empty without a view."""
    speculating = {name: v for name, v in policy.items() if name != "ar"}
    if "ar" not in policy or not speculating:
        return ""
    name, best = max(speculating.items(), key=lambda item: item[1]["tokens_per_ms"])
    plain = policy["ar"]
    return (
        f"plain decoding {plain['tokens_per_ms']:.3f} tokens/ms ({plain['cost_ms']:.2f} ms a step), its best "
        f"speculating round `{name}` {best['tokens_per_ms']:.3f} ({best['expected_tokens']:.2f} tokens expected "
        f"in {best['cost_ms']:.2f} ms)"
    )


def _aggregate(records: list[dict]) -> dict:
    rounds = sum(r["rounds"] for r in records)
    accepted = sum(sum(r["accepted"]) for r in records)
    decode_s = sum(r["decode_s"] for r in records)
    tokens = sum(max(r["num_new_tokens"] - 1, 0) for r in records)
    split = {k: sum(r[k] for r in records) for k in ("draft_s", "verify_s", "overhead_s")}
    trees: dict[str, int] = {}  # rounds per tree (longspec; tree=auto may change it every round)
    for r in records:
        for name, count in (r.get("trees") or {}).items():
            trees[name] = trees.get(name, 0) + count
    out = {
        "trees": trees,
        # tree=auto's view at the end of the last sample (GenerationStats.policy): why it ran what it ran
        "policy": (records[-1].get("policy") or {}) if records else {},
        # P(depth d accepted | depths < d were), pooled over rounds: the drafter's measured acceptance profile
        # (e.g. benchmarks/batch_throughput.py --accept-profile).
        "acceptance_profile": pooled_acceptance_profile(records),
        "num_samples": len(records),
        "mean_prompt_len": sum(r["prompt_len"] for r in records) / max(len(records), 1),
        "rounds": rounds,
        # One round = one target forward: a decode step for the target-only methods, draft + verify for longspec.
        "ms_per_round": 1000 * decode_s / rounds if rounds else math.nan,
        # τ over the whole dataset: tokens emitted per target forward (ALGORITHM §5).
        "mean_accept_length": (accepted + rounds) / rounds if rounds else math.nan,
        # Decode throughput, prefill excluded, pooled over samples (long outputs weigh more, as in wall time).
        "tokens_per_s": tokens / decode_s if decode_s > 0 and tokens > 0 else math.nan,
        "decode_s": decode_s,
        "time_split": {k: (v / decode_s if decode_s > 0 else math.nan) for k, v in split.items()},
    }
    if any("batch_tokens_per_s" in r for r in records):
        out["batch_tokens_per_s"] = _batch_throughput(records)
    return out


def _batch_throughput(records: list[dict]) -> float:
    """Tokens/s of samples decoded in batches (eval batch_size > 1): each sample's tokens are charged their share
    of its batch's decode time (its tokens / the batch's throughput), so whole batches give all their tokens over
    their wall time, and a subset of a batch (degenerate samples set apart) the batch's rate. A sample decoded
    alone (an HF baseline) is charged its own decode time."""
    tokens = seconds = 0.0
    for r in records:
        n = max(r["num_new_tokens"] - 1, 0)
        rate = r.get("batch_tokens_per_s", r["tokens_per_s"])
        if n and rate is not None and rate > 0:  # rate NaN: no decoded token in the whole batch
            tokens, seconds = tokens + n, seconds + n / rate
    return tokens / seconds if seconds > 0 else math.nan


def throughput(agg: dict) -> float:
    """What a speedup compares: the batch throughput when the method ran batched, else tokens/s."""
    return agg.get("batch_tokens_per_s", agg["tokens_per_s"])


def sample_quality(methods: dict[str, dict[str, list[dict]]], dataset: str) -> dict[str, dict]:
    """id -> quality (longspec.eval.quality) of what the target wrote for each sample of `dataset`: the
    target-only reference method's output (greedy at T = 0, sampled at T > 0), else -- a run without one -- each
    sample's output from the first method that has it. A sample is degenerate too where another method's output
    differs from that one and is degenerate itself: at T = 0 a bf16 near-tie can send one method into a loop the
    reference never wrote (GPU, gov_report_8k: graph AR stopped after 19 tokens at an end-of-text near-tie,
    longspec and pld went on with 109 tokens of one repeated sentence and read 3.9x and 4.3x), and a speed
    measured on a loop is not a result. `judged_on` names the method whose output decided."""
    present = [m for m in methods if dataset in methods[m]]
    reference = greedy_reference(present)
    order = [reference] + [m for m in present if m != reference] if reference else present
    quality: dict[str, dict] = {}
    judged: dict[str, list[int]] = {}  # id -> the output its verdict is about
    for method in order:
        for record in methods[method][dataset]:
            sample, output = record["id"], record["output_ids"]
            if sample in quality and (quality[sample]["degenerate"] or output == judged[sample]):
                continue
            verdict = assess(output)
            if sample not in quality or verdict.degenerate:
                quality[sample] = verdict.to_dict() | {"judged_on": method}
                judged[sample] = output
    return quality


def summarise(methods: dict[str, dict[str, list[dict]]], *, greedy: bool) -> dict[str, dict[str, dict]]:
    """methods[method][dataset] = per-sample records -> summary[dataset][method].

    The headline figures (τ, tokens/s, speedups) exclude samples whose target reference output is degenerate
    (longspec.eval.quality): `degenerate_samples` aggregates those apart, `all_samples` everything together,
    and `quality` holds every sample's distinct-token ratio and flag. The lossless check covers every sample."""
    datasets = sorted({d for per_dataset in methods.values() for d in per_dataset})
    summary: dict[str, dict[str, dict]] = {}
    for dataset in datasets:
        quality = sample_quality(methods, dataset)
        degenerate = {i for i, q in quality.items() if q["degenerate"]}
        per_method = {}
        for m, recs in methods.items():
            if dataset not in recs:
                continue
            kept = [r for r in recs[dataset] if r["id"] not in degenerate]
            flagged = [r for r in recs[dataset] if r["id"] in degenerate]
            per_method[m] = _aggregate(kept) | {
                "num_degenerate": len(flagged),
                "degenerate_samples": _aggregate(flagged) if flagged else None,
                "all_samples": _aggregate(recs[dataset]),
                "quality": quality,
            }
        for method, agg in per_method.items():
            agg["speedup"] = {
                base: throughput(agg) / throughput(per_method[base])
                for base in BASELINES
                if base in per_method and base != method and throughput(per_method[base]) > 0
            }
        reference = greedy_reference(per_method)
        for method, agg in per_method.items():
            agg["greedy_reference"] = reference if greedy else None
            if not greedy or reference is None:
                agg["identical_to_greedy"] = None  # sampling, or no target-only method in the run
                continue
            ref_outputs = {r["id"]: r["output_ids"] for r in methods[reference][dataset]}
            records = methods[method][dataset]
            differing = [r for r in records if r["output_ids"] != ref_outputs.get(r["id"])]
            agg["identical_to_greedy"] = 1 - len(differing) / max(len(records), 1)
            # A difference is explained only by an analysis (longspec.eval.divergence): a near-tie, or the
            # reference's own departure from the target's argmax (`reference_off`, absent from older results);
            # one that was not analysed (no `divergence` entry) counts against the lossless check.
            analysed = [r["divergence"] for r in differing if r.get("divergence")]
            ties = [d for d in analysed if d["near_tie"]]
            reference_off = [d for d in analysed if d.get("reference_off")]
            agg["near_ties"] = len(ties)
            agg["max_tie_gap"] = max((abs(t["gap"]) for t in ties), default=None)
            agg["reference_divergences"] = len(reference_off)
            agg["max_reference_gap"] = max((abs(d["gap"]) for d in reference_off), default=None)
            agg["unexplained_divergences"] = len(differing) - len(ties) - len(reference_off)
            # How far past the tolerance an unexplained divergence is, in units in the last place of the top
            # logit (the tolerance is 2 of them): a few ulps reads as rounding beyond the check's margin,
            # thousands as a logic error. None: none with a gap (unanalysed, or one output stopped early).
            agg["max_divergence_ulps"] = max(
                (gap_ulps(d["gap"], d["tolerance"]) for d in analysed
                 if not explained(d) and d["gap"] is not None and d["tolerance"]),
                default=None,
            )  # fmt: skip
        summary[dataset] = per_method
    return summary


def recorded_generation(config: dict) -> dict:
    """The decode settings a results.json records: its config's `generation` (a flat config in files written
    before the eval nested GenerationConfig)."""
    return config.get("generation", config)


def greedy_reference(methods) -> str | None:
    """The target-only method whose output the others are checked against (None: the run has none)."""
    return next((m for m in GREEDY_REFERENCES if m in methods), None)


def identical_text(agg: dict) -> str:
    """'yes' / '50% (1 near-tie, logit gap <= 0.0625)' / '50% (1 where the reference left the target's argmax,
    by <= 0.5)' / '50% (1 NOT a near-tie, logit gap up to 4 ulp against a tolerance of 2)' / 'n/a' (sampling). No
    pipe characters: the text goes into markdown table cells."""
    ident = agg.get("identical_to_greedy")
    if ident is None:
        return "n/a"
    if ident == 1:
        return "yes"
    notes = []
    if agg["near_ties"]:
        plural = "s" if agg["near_ties"] > 1 else ""
        notes.append(f"{agg['near_ties']} near-tie{plural}, logit gap <= {agg['max_tie_gap']:.3g}")
    if agg.get("reference_divergences"):
        notes.append(
            f"{agg['reference_divergences']} where the reference left the target's argmax, "
            f"by <= {agg['max_reference_gap']:.3g}"
        )
    if agg["unexplained_divergences"]:
        ulps = agg.get("max_divergence_ulps")
        gap = "" if ulps is None else f", logit gap up to {ulps:.3g} ulp against a tolerance of {TIE_ULPS:g}"
        notes.append(f"{agg['unexplained_divergences']} NOT a near-tie{gap}")
    return f"{ident * 100:.0f}% ({'; '.join(notes)})"


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
        f"{results['started']}"
        + (f" · commit {results['commit']}" if results.get("commit") else ""),
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
            cells += [
                _fmt(agg["mean_accept_length"], ".2f"),
                _fmt(agg["tokens_per_s"], ".1f"),
                _fmt(speedup, ".2f") + "x",
            ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")

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
            speedups = ", ".join(f"{_fmt(v, '.2f')}x vs {b}" for b, v in agg["speedup"].items()) or "–"
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


def timing_markdown(results: dict) -> list[str]:
    """With timing_repeats > 1: how far a sample's interleaved runs spread (max / min - 1 of decode time), per
    method: the run-to-run variation the fastest-run figures above leave out, to read small speedups against."""
    repeats = results["config"].get("timing_repeats", 1)
    if repeats <= 1:
        return []
    lines = ["", f"## Timing ({repeats} interleaved runs per sample, the fastest kept)", ""]
    for method, per_dataset in results["methods"].items():
        spreads = sorted(
            max(times) / min(times) - 1
            for records in per_dataset.values()
            for record in records
            if len(times := [run["decode_s"] for run in record.get("timing_runs", [])]) > 1 and min(times) > 0
        )
        if spreads:
            median = spreads[len(spreads) // 2]
            lines.append(
                f"- {method}: a sample's runs spread by {100 * median:.0f}% (median), {100 * spreads[-1]:.0f}% "
                f"(most), over {len(spreads)} samples"
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
    results["summary"] = summarise(results["methods"], greedy=recorded_generation(results["config"]).get("temperature", 0) == 0)
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
