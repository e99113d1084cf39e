"""Where speculative rounds' time went, from the round logs a run recorded (`GenerationStats.round_trees` /
`round_ms`): what each round shape really cost next to the warm-up's table, and what each family of rounds gained
or lost against plain decoding.

    python benchmarks/round_log.py EVAL_DIR/results.json [...]    # python -m longspec.eval, ar among its methods
    python benchmarks/round_log.py OUT/decode_methods.json [...]  # decode_methods.py, ar_graphs beside longspec

Each longspec call is compared with the plain step of the same source: the eval's `ar` records of the dataset,
decode_methods' `ar_graphs` row of the context (the median round, first rounds and first repeat left out).
- Costs: per (context bucket, round shape), the median round, the table entry the policy started from
  (`round_costs_s`; the last input's where several measured one), and the median after a round of the same shape
  vs after another (a drafting round after plain or lookup rounds runs the ring's catch-up first).
- Balance: per family (plain, drafter tree, lookup) and phase (a call's first 5 rounds, a speculating round right
  after a plain one, i.e. mostly explorations, and the rest), rounds, drafts accepted per round and the
  milliseconds lost against plain decoding: round ms - tokens emitted x the plain step's ms. Negative: a gain.
Rounds over STALL x their shape's median are left out and counted (a collection or another process stalled them).
Writes round_log.json to $OUT (or --json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from longspec.atomic import write_json_atomic  # noqa: E402
from longspec.infer.policy import context_bucket  # noqa: E402

STALL = 10.0  # a round this many times its shape's median was stalled, not run
FIRST = 5  # a call's first rounds: its policy still runs on what earlier calls taught it


def calls(results: dict) -> list[dict]:
    """Every longspec call of an eval results.json or a decode_methods.json, as {source, context, trees, ms,
    accepted, plain_ms, table}: its round log and the plain step's median ms of the same source."""
    out = []
    if "methods" in results:  # python -m longspec.eval
        table = results.get("round_costs_s") or {}
        ar = results["methods"].get("ar") or {}
        for dataset, records in (results["methods"].get("longspec") or {}).items():
            plain = [ms for r in ar.get(dataset, []) for ms in r.get("round_ms", [])[FIRST:]]
            for r in records:
                if not r.get("round_trees"):  # recorded before round logs existed (or a call of no round)
                    continue
                out.append(
                    _call(
                        dataset, r["prompt_len"], r["round_trees"], r["round_ms"], r["accepted"], plain, table
                    )
                )
    else:  # decode_methods.py
        rows = {(row["method"], row["context"]): row for row in results["rows"]}
        for (method, context), row in rows.items():
            if not method.startswith("longspec"):
                continue
            ar = rows.get((method.replace("longspec", "ar"), context)) or {}
            plain = [ms for rep in ar.get("rounds", [])[1:] for _, _, ms in rep[FIRST:]]
            for rep in row.get("rounds", []):
                trees, accepted, ms = zip(*rep, strict=True) if rep else ((), (), ())
                out.append(
                    _call(str(context), context, trees, ms, accepted, plain, row.get("round_costs_s") or {})
                )
    return out


def _call(source, context, trees, ms, accepted, plain, table) -> dict:
    if not plain:
        raise SystemExit(f"{source}: no plain rounds to compare with (run ar / ar_graphs beside longspec)")
    return {"source": source, "context": context, "trees": list(trees), "ms": list(ms), "accepted": list(accepted),
            "plain_ms": statistics.median(plain), "table": table}  # fmt: skip


def family(tree: str) -> str:
    return "plain" if tree == "ar" else "lookup" if tree.startswith("lookup") else "drafter"


def analyse(all_calls: list[dict]) -> dict:
    """The two tables of the module docstring, from `calls`."""
    by_shape: dict[tuple, dict] = defaultdict(lambda: {"all": [], "same": [], "switch": [], "table": None})
    for call in all_calls:
        bucket = context_bucket(call["context"])
        for i, (tree, ms) in enumerate(zip(call["trees"], call["ms"], strict=True)):
            entry = by_shape[(bucket, tree)]
            entry["all"].append(ms)
            if i:
                entry["same" if call["trees"][i - 1] == tree else "switch"].append(ms)
            seconds = call["table"].get(f"{bucket}:{tree}")
            entry["table"] = None if seconds is None else seconds * 1e3
    medians = {key: statistics.median(v["all"]) for key, v in by_shape.items()}
    balance: dict[tuple, dict] = defaultdict(lambda: {"rounds": 0, "drafts": 0, "lost_ms": 0.0})
    stalls, total = 0, 0.0
    for call in all_calls:
        bucket = context_bucket(call["context"])
        for i, (tree, ms, drafts) in enumerate(zip(call["trees"], call["ms"], call["accepted"], strict=True)):
            if ms > STALL * medians[(bucket, tree)]:
                stalls += 1
                continue
            fam = family(tree)
            after_plain = i > 0 and call["trees"][i - 1] == "ar" and fam != "plain"
            phase = "first rounds" if i < FIRST else "after a plain round" if after_plain else "in a run"
            cell = balance[(fam, phase)]
            cell["rounds"] += 1
            cell["drafts"] += drafts
            cell["lost_ms"] += ms - (drafts + 1) * call["plain_ms"]
            total += ms
    costs = [
        {"bucket": bucket, "tree": tree, "rounds": len(v["all"]), "median_ms": statistics.median(v["all"]),
         "table_ms": v["table"], "after_same_ms": _median(v["same"]), "after_other_ms": _median(v["switch"])}
        for (bucket, tree), v in sorted(by_shape.items())
    ]  # fmt: skip
    rows = [{"family": f, "phase": p, **cell} for (f, p), cell in sorted(balance.items())]
    lost = sum(cell["lost_ms"] for cell in balance.values())
    return {"costs": costs, "balance": rows, "round_ms": total, "lost_ms": lost, "stalls": stalls,
            "lost_share": lost / total if total else float("nan")}  # fmt: skip


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.3f}"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "results", nargs="+", help="results.json of python -m longspec.eval, or decode_methods.json"
    )
    parser.add_argument("--json", default=None, help="output path when $OUT is not set")
    args = parser.parse_args(argv)
    all_calls = []
    for path in args.results:
        with open(path) as f:
            all_calls += calls(json.load(f))
    if not all_calls:
        raise SystemExit("no longspec call with a round log in the results")
    report = analyse(all_calls)
    print("| bucket | round | rounds | median ms | table ms | after itself ms | after another ms |")
    print("|---|---|---|---|---|---|---|")
    for c in report["costs"]:
        print(f"| {c['bucket']} | {c['tree']} | {c['rounds']} | {_fmt(c['median_ms'])} | {_fmt(c['table_ms'])} | "
              f"{_fmt(c['after_same_ms'])} | {_fmt(c['after_other_ms'])} |")  # fmt: skip
    print("\n| family | phase | rounds | drafts per round | ms lost vs plain |")
    print("|---|---|---|---|---|")
    for b in report["balance"]:
        print(
            f"| {b['family']} | {b['phase']} | {b['rounds']} | {b['drafts'] / b['rounds']:.2f} | {b['lost_ms']:+.1f} |"
        )
    print(
        f"\n{len(all_calls)} calls, {report['round_ms'] / 1e3:.2f} s of rounds: {report['lost_ms']:+.1f} ms against "
        f"plain decoding ({100 * report['lost_share']:+.2f}%); {report['stalls']} stalled rounds left out"
    )
    out = os.path.join(os.environ["OUT"], "round_log.json") if os.environ.get("OUT") else args.json
    if out:
        write_json_atomic(out, {"inputs": args.results, **report})
    return report


if __name__ == "__main__":
    main()
