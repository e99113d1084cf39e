"""Replay tree=auto's policy over an evaluation's real outputs, offline: what its decisions are worth on the texts a
target really wrote, at the round costs the device really measured, in seconds on a CPU and with no GPU time.

A GPU evaluation (`python -m longspec.eval ... tree=auto`) records each sample's output tokens and the round-cost
table of its warm-up (`round_costs_s`). Here every sample is decoded again on paper, in the evaluation's order
(the policy's estimates carry from call to call, as in the run):
- a lookup's outcome is exact: the n-gram drafts at each root (`pld.LookupShadow`, the engine's own host
  lookup; a forest's branches too) against the tokens the output really continues with; the shadow reports of
  the rounds that run none come from a `LookupShadow` run next to the replay as the engine runs its own (the
  prompt and the first token, then each round's tokens), so they are heard when the engine hears them: a quote
  decoded plain as it goes on (the drafts matched so far, right-censored), and once more when the text resolves
  it;
- a drafter tree's outcome is a stand-in (the one of batch_throughput.py): depth d accepted with probability p_d of
  a measured profile (`--accept-profile`, e.g. the same run's `eval_t0_full_tree/results.json`), independently
  per round; no text, so the stand-in does not know which passages the drafter predicts well;
- each round costs its measured table entry at the sample's context length, a drafter round after plain or lookup
  rounds `--catch-up-ms` more (the ring's catch-up); the policy learns outcomes and times one round late, as the
  engine's one-round-ahead loop gives them (with the engine's `switched` flag for the rounds that caught up).
Per sample: tokens per second relative to plain decoding (every round an AR step) and the rounds by candidate;
next to it, where the results hold the `ar` method, the speedup the GPU run measured for that sample, and with
`--fixed NAME` the same texts replayed with one candidate every round (e.g. lookup16: close to pld, which runs a
lookup chain every round), a reference for what the policy's choices gain or lose. Use it to
judge a change of the policy (its priors, memories, candidates) on real texts before spending device time.

    python benchmarks/policy_replay.py EVAL_DIR/results.json --tokenizer TARGET_DIR \\
        --accept-profile FULL_TREE_EVAL_DIR/results.json [--data-dir DIR_OF_THE_JSONL_FILES]

Writes policy_replay.json ($OUT or --json) and prints a table per sample.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from longspec.atomic import write_json_atomic  # noqa: E402
from longspec.eval.datasets import recorded_prompts  # noqa: E402
from longspec.infer.candidates import AUTO_LOOKUPS, AUTO_TREES, Plain, parse  # noqa: E402
from longspec.infer.config import GenerationConfig  # noqa: E402
from longspec.infer.policy import AdaptivePolicy, FixedPolicy, MeasuredCosts  # noqa: E402
from longspec.infer.policy.shadow import LookupShadow  # noqa: E402
from longspec.provenance import run_info  # noqa: E402
from longspec.target_source import load_tokenizer  # noqa: E402


def cost_table(results: dict) -> MeasuredCosts:
    """The evaluation's measured round costs ("bucket:name" -> seconds) as the policy's cost model."""
    table = results.get("round_costs_s")
    if not table:
        raise SystemExit("the results hold no round_costs_s: replay an evaluation run with tree=auto")
    seconds = {}
    for key, value in table.items():
        bucket, name = key.split(":", 1)
        seconds[(int(bucket), parse(name))] = float(value)
    return MeasuredCosts(seconds=seconds)


def lookup_outcomes(
    prompt: list[int], output: list[int], length: int, max_ngram: int, branches: int = 1
) -> list[list[int]]:
    """outcomes[i]: per branch of a lookup of `branches` x `length` at root output[i] (i < len(output) - 1), the
    drafts it accepts: the common prefix of the branch's draft and the tokens the output continues with ([] where
    nothing matches)."""
    shadow = LookupShadow(list(prompt) + output[:1], length, max_ngram, branches)
    outcomes = []
    for i in range(len(output) - 1):
        matched = []
        for draft in shadow.draft():
            n = 0
            while n < len(draft) and i + 1 + n < len(output) and draft[n] == output[i + 1 + n]:
                n += 1
            matched.append(n)
        outcomes.append(matched)
        shadow.extend([output[i + 1]], shadow=False)  # into the index; no draft of its own to track
    return outcomes


def replay_call(
    policy,
    rng,
    prompt: list[int],
    output: list[int],
    outcomes: list[list[int]],
    profile: list[float],
    costs,
    catch_up_s: float = 0.0,
    max_ngram: int = GenerationConfig().pld_max_ngram,
) -> dict:
    """One sample's decode on paper (see the module docstring); returns its speedup over plain and rounds.
    `policy`: tree="auto"'s (`AdaptivePolicy`) or a `FixedPolicy` (one candidate every round, a reference).
    `outcomes`: `lookup_outcomes` of the call's text, taken with the policy's longest and widest lookups.
    `catch_up_s`: what a drafter round after plain or lookup rounds pays on top of its table cost (the ring's
    catch-up; a table round runs after rounds of its own kind)."""
    if isinstance(policy, AdaptivePolicy):
        policy.start()
    shadow = _shadow(policy, prompt, output[:1], max_ngram)
    pending, rounds, spent, position = [], Counter(), 0.0, 0
    ring_behind = False
    plain = 0.0
    while position < len(outcomes):
        index = sum(rounds.values())
        while pending and pending[0][0] <= index - 2:  # the engine's policy hears round j - 2 at round j
            _hear(policy, *pending.pop(0))
        context_len = len(prompt) + position
        widths = policy.choose(context_len)
        if widths.drafts_by_lookup:
            ranks = widths.ranks(outcomes[position])
        else:
            ranks = []
            for depth in range(widths.depth):
                if depth >= len(profile) or rng.random() >= profile[depth]:
                    break
                ranks.append(0)
        accepted = len(ranks)
        emitted = min(accepted + 1, len(outcomes) - position)  # the last round stops at the output's end
        drafting = widths.drafts_with_drafter
        switched = drafting and ring_behind
        seconds = costs.cost(widths, context_len) + (catch_up_s if switched else 0.0)
        ring_behind = not drafting
        rounds[widths.name] += 1
        spent += seconds
        for step in range(emitted):
            plain += costs.cost(Plain(), context_len + step)
        tokens = output[position + 1 : position + 1 + emitted]
        reports = [] if shadow is None else shadow.extend(tokens, shadow=not widths.drafts_by_lookup)
        position += emitted
        pending.append((index, widths, ranks, context_len, seconds, switched, reports))
    for lesson in pending:  # the call's last lessons, for the next call
        _hear(policy, *lesson)
    return {"speedup": plain / spent if spent else 1.0, "rounds": dict(rounds), "tokens": position}


def _shadow(policy, prompt: list[int], first: list[int], max_ngram: int) -> LookupShadow | None:
    """The shadow lookup the engine runs for a call of `policy` (`SpeculativeEngine.generate_batch`): where the
    policy has lookup candidates, as long as the longest and as wide as the widest, its context the prompt and
    the call's first token."""
    lookups = getattr(policy, "lookups", ())
    if not lookups:
        return None
    length, branches = max(t.length for t in lookups), max(t.branches for t in lookups)
    shadow = LookupShadow(list(prompt), length, max_ngram, branches)
    shadow.extend(first, shadow=False)
    return shadow


def _replay_calls(policy, rng, calls, profile, costs, catch_up_s, max_ngram) -> list[dict]:
    """Every call in order, one policy (its estimates carry from call to call, as in the evaluation)."""
    return [
        replay_call(policy, rng, prompt, r["output_ids"], o, profile, costs, catch_up_s, max_ngram)
        for _, r, prompt, o in calls
    ]


def _hear(policy, index, widths, ranks, context_len, seconds, switched, reports) -> None:
    """A settled round's lessons, in the engine's order (`loop.DecodeLoop._observe`; a call's first round
    teaches no round cost there)."""
    if index:
        policy.observe_time(widths, context_len, seconds, switched=switched)
    policy.observe(widths, ranks, context_len)
    for report in reports:
        policy.observe_shadow(report)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="results.json of a tree=auto evaluation (python -m longspec.eval)")
    parser.add_argument("--tokenizer", required=True, help="the target's directory (or GGUF) for the prompts")
    parser.add_argument("--gguf-file", default=None)
    parser.add_argument(
        "--data-dir", default=None, help="where the evaluation's JSONL files are now (by name)"
    )
    parser.add_argument(
        "--accept-profile",
        default="0",
        help="p1,p2,...: the drafter stand-in's per-depth acceptance, or an eval results.json to measure it from",
    )
    parser.add_argument("--method", default="longspec", help="whose recorded outputs to replay")
    parser.add_argument("--seeds", type=int, default=8, help="stand-in draws averaged per sample")
    parser.add_argument(
        "--fixed",
        default=None,
        help="also replay one candidate every round as a reference, by its report name (e.g. lookup16, 1-1-1-1)",
    )
    parser.add_argument(
        "--catch-up-ms",
        type=float,
        default=0.0,
        help="added to a drafter round after plain or lookup rounds: the ring's catch-up "
        "(`round_latency.py --round-costs` measures it)",
    )
    parser.add_argument("--json", default=None, help="output path when $OUT is not set")
    args = parser.parse_args(argv)

    with open(args.results) as f:
        results = json.load(f)
    if int(results["config"].get("batch_size") or 1) != 1:
        # a batch's policy decides for all its rows at once, at the batch's round costs: not one call per sample
        raise SystemExit("policy_replay replays an evaluation decoded one sample at a time (batch_size=1)")
    costs = cost_table(results)
    profile = _profile(args.accept_profile)
    tokenizer = load_tokenizer(args.tokenizer, args.gguf_file)
    prompts = recorded_prompts(
        results["config"]["data"], tokenizer, args.data_dir, context_len=results.get("context_len")
    )
    measured = _measured_speedups(results, args.method)

    config = GenerationConfig()
    lookups = [c for c in _candidates(costs) if c.drafts_by_lookup] or list(AUTO_LOOKUPS)
    longest, widest = max(t.length for t in lookups), max(t.branches for t in lookups)
    calls = []  # (dataset, record, prompt, lookup outcomes) in the evaluation's order
    for dataset, records in results["methods"][args.method].items():
        for record in records:
            prompt = prompts.get((dataset, str(record["id"])))
            if prompt is None or len(prompt) != record["prompt_len"]:
                raise SystemExit(
                    f"{dataset} / {record['id']}: the prompt is not the evaluation's ({record['prompt_len']} "
                    f"tokens there, {None if prompt is None else len(prompt)} here): another tokenizer or data file"
                )
            outcomes = lookup_outcomes(prompt, record["output_ids"], longest, config.pld_max_ngram, widest)
            calls.append((dataset, record, prompt, outcomes))

    fixed = parse(args.fixed) if args.fixed else None
    if fixed is not None and fixed not in _candidates(costs):
        raise SystemExit(
            f"--fixed {args.fixed}: not a candidate the evaluation measured ({sorted(costs.to_dict())})"
        )
    per_seed, per_seed_fixed = [], []
    catch_up = args.catch_up_ms / 1e3
    for seed in range(args.seeds):
        rng, policy = random.Random(seed), AdaptivePolicy(costs, _candidates(costs))
        per_seed.append(_replay_calls(policy, rng, calls, profile, costs, catch_up, config.pld_max_ngram))
        if fixed is not None:
            rng, policy = random.Random(seed), FixedPolicy(fixed)
            per_seed_fixed.append(
                _replay_calls(policy, rng, calls, profile, costs, catch_up, config.pld_max_ngram)
            )
    rows = []
    for i, (dataset, record, _, outcomes) in enumerate(calls):
        rounds = Counter()
        for run in per_seed:
            rounds.update(run[i]["rounds"])
        rows.append(
            {
                "dataset": dataset,
                "id": str(record["id"]),
                "tokens": len(record["output_ids"]),
                "lookup_hit_rate": sum(1 for n in outcomes if n and n[0]) / max(len(outcomes), 1),
                "replayed_speedup": statistics.mean(run[i]["speedup"] for run in per_seed),
                "measured_speedup": measured.get((dataset, str(record["id"]))),
                "fixed_speedup": statistics.mean(run[i]["speedup"] for run in per_seed_fixed)
                if fixed is not None
                else None,
                "rounds": {name: count / args.seeds for name, count in rounds.most_common()},
            }
        )
    summary = {
        "mean_replayed_speedup": statistics.mean(r["replayed_speedup"] for r in rows) if rows else None,
        "worst_replayed_speedup": min((r["replayed_speedup"] for r in rows), default=None),
        "fixed": args.fixed,
        "mean_fixed_speedup": statistics.mean(r["fixed_speedup"] for r in rows)
        if fixed is not None and rows
        else None,
        # tokens per round over all samples (the decode's τ), the policy's and the fixed candidate's
        "tau": _tau(per_seed),
        "fixed_tau": _tau(per_seed_fixed) if fixed is not None else None,
    }
    ref = f" {args.fixed} / plain |" if fixed is not None else ""
    print(
        f"| dataset | tokens | lookup hits | replayed / plain |{ref} measured / ar | rounds (mean per draw) |"
    )
    print("|---|---|---|---|---|---|" + ("---|" if fixed is not None else ""))
    for r in rows:
        shown = ", ".join(f"{name} {count:.0f}" for name, count in r["rounds"].items())
        m = "–" if r["measured_speedup"] is None else f"{r['measured_speedup']:.2f}"
        f = f" {r['fixed_speedup']:.2f} |" if fixed is not None else ""
        cells = f"{r['lookup_hit_rate']:.0%} | {r['replayed_speedup']:.2f} |{f} {m}"
        print(f"| {r['dataset']} | {r['tokens']} | {cells} | {shown} |")
    line = f"mean {summary['mean_replayed_speedup']:.3f}, worst {summary['worst_replayed_speedup']:.3f}"
    line += f", τ {summary['tau']:.2f}"
    if fixed is not None:
        line += f"; {args.fixed} every round: mean {summary['mean_fixed_speedup']:.3f}, τ {summary['fixed_tau']:.2f}"
    print(line)
    out = args.json or os.path.join(os.environ.get("OUT", "."), "policy_replay.json")
    write_json_atomic(
        out,
        {
            "run": run_info(),
            "results": os.path.abspath(args.results),
            "profile": profile,
            "seeds": args.seeds,
            "samples": rows,
            "summary": summary,
        },
    )
    print(f"wrote {out}")
    return 0


def _tau(runs: list[list[dict]]) -> float:
    """Tokens per round over every sample and draw (each output's first token is the prefill's, not a round's)."""
    tokens = sum(call["tokens"] for run in runs for call in run)
    rounds = sum(sum(call["rounds"].values()) for run in runs for call in run)
    return tokens / rounds if rounds else float("nan")


def _candidates(costs: MeasuredCosts) -> list:
    """The candidates the evaluation measured, in tree="auto"'s order (ties go to the earlier one)."""
    seen = {candidate for _, candidate in costs.seconds}
    known = [c for c in AUTO_TREES + AUTO_LOOKUPS if c in seen]
    return known + sorted(seen - set(known), key=lambda c: c.sort_key)


def _profile(text: str) -> list[float]:
    if os.path.isfile(text):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from batch_throughput import measured_profile

        return measured_profile(text)
    return [float(p) for p in text.split(",") if p.strip()]


def _measured_speedups(results: dict, method: str) -> dict:
    """(dataset, id) -> the run's tokens/s of `method` over ar's for that sample, where both were run."""
    ar = {
        (dataset, str(r["id"])): r["tokens_per_s"]
        for dataset, records in results["methods"].get("ar", {}).items()
        for r in records
    }
    return {
        (dataset, str(r["id"])): r["tokens_per_s"] / ar[(dataset, str(r["id"]))]
        for dataset, records in results["methods"][method].items()
        for r in records
        if ar.get((dataset, str(r["id"])))
    }


if __name__ == "__main__":
    sys.exit(main())
