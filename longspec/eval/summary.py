"""Per-dataset summaries of an evaluation's records: τ, tokens/s, speedups measured in the same run, the lossless
check's verdicts and the quality guard (what `report` renders, and the pipeline reads from results.json)."""

from __future__ import annotations

import math

from longspec.eval.divergence import TIE_ULPS, explained, gap_ulps
from longspec.eval.quality import assess
from longspec.infer.stats import acceptance_profile

__all__ = [
    "BASELINES",
    "GREEDY_REFERENCES",
    "MAX_TIMING_SPREAD",
    "greedy_reference",
    "identical_text",
    "policy_view",
    "pooled_acceptance_profile",
    "recorded_generation",
    "sample_quality",
    "summarise",
    "throughput",
    "timing_spread",
    "unstable_note",
]

# Methods a speedup can be quoted against, the paper's baseline (vanilla FlashAttention) first.
BASELINES = ("vanilla_fa", "vanilla_hf", "hf_compile", "ar", "pld")
# Target-only methods whose output IS the target's greedy output (the lossless reference at T = 0).
GREEDY_REFERENCES = ("ar", "vanilla_fa", "hf_compile", "vanilla_hf")
# A sample whose interleaved timed runs of one method (eval timing_repeats > 1) spread more than this (slowest /
# fastest decode time) was timed on a busy machine: no speedup is quoted from a cell holding one. The eval's
# max_timing_spread sets another.
MAX_TIMING_SPREAD = 1.5


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


def timing_spread(record: dict) -> float | None:
    """Slowest / fastest decode time of a record's interleaved runs (None: it was timed once)."""
    times = [run["decode_s"] for run in record.get("timing_runs", [])]
    return max(times) / min(times) if len(times) > 1 and min(times) > 0 else None


def unstable_note(max_spread: float) -> str:
    """The one line a report gives for speedups left out as unstable (`summarise`'s `unstable_vs`)."""
    return (
        f"unstable: a sample's interleaved runs of that method or of its baseline spread more than {max_spread:g}x "
        "(slowest / fastest: a busy machine), so no speedup is quoted from them; rerun on a quieter machine."
    )


def _aggregate(records: list[dict], max_spread: float = MAX_TIMING_SPREAD) -> dict:
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
        # samples whose interleaved runs spread more than max_spread: their time says little (see MAX_TIMING_SPREAD)
        "unstable_samples": [r["id"] for r in records if (timing_spread(r) or 1.0) > max_spread],
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
    reference never wrote (the reference stops at an end-of-text near-tie while another method goes on
    repeating one sentence at a high speedup), and a speed measured on a loop is not a result. `judged_on` names
    the method whose output decided."""
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


def summarise(
    methods: dict[str, dict[str, list[dict]]], *, greedy: bool, max_spread: float = MAX_TIMING_SPREAD
) -> dict[str, dict[str, dict]]:
    """methods[method][dataset] = per-sample records -> summary[dataset][method].

    The headline figures (τ, tokens/s, speedups) exclude samples whose target reference output is degenerate
    (longspec.eval.quality): `degenerate_samples` aggregates those apart, `all_samples` everything together,
    and `quality` holds every sample's distinct-token ratio and flag. The lossless check covers every sample.
    A speedup between two methods is left out (its baseline listed in `unstable_vs`) when either has a sample
    whose interleaved runs spread more than `max_spread` (`unstable_samples`)."""
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
            per_method[m] = _aggregate(kept, max_spread) | {
                "num_degenerate": len(flagged),
                "degenerate_samples": _aggregate(flagged, max_spread) if flagged else None,
                "all_samples": _aggregate(recs[dataset], max_spread),
                "quality": quality,
            }
        for method, agg in per_method.items():
            bases = [
                b for b in BASELINES if b in per_method and b != method and throughput(per_method[b]) > 0
            ]
            agg["unstable_vs"] = [
                b for b in bases if agg["unstable_samples"] or per_method[b]["unstable_samples"]
            ]
            agg["speedup"] = {
                b: throughput(agg) / throughput(per_method[b]) for b in bases if b not in agg["unstable_vs"]
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
