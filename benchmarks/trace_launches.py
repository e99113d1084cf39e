"""A profiler trace's device work cut into launches: which kernels a round runs, in what order, and how long each
takes. A graph replay runs its kernels back to back; the device idles between one launch (a graph, a copy, an
eager op) and the next, so an idle gap longer than --gap µs starts a new group. Each group prints its kernel
count, its span and busy time, and its kernels by name (counted); --show N prints group N's kernels in order.

    python benchmarks/decode_methods.py --shape smollm2 --contexts 4096 --methods longspec_graphs --tree 1 \\
        --profile            # writes $OUT/trace_<method>_<context>.json.gz
    python benchmarks/trace_launches.py $OUT/trace_longspec_graphs_4096.json.gz --skip 0.7 --groups 6
    python benchmarks/trace_launches.py TRACE --skip 0.7 --show 3   # one group's kernels, in order

--skip F starts at that fraction of the trace (past prefill and warm-up). Times are the profiler's: it adds a
little to every launch, so compare groups of one trace, not traces of different runs.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(trace: dict) -> list[dict]:
    """The trace's device kernels, copies and sets (complete events), in start order."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    return sorted(events, key=lambda e: e["ts"])


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and namespaces (`at::native::...<...>` -> the function)."""
    name = name.removeprefix("void ")
    name = re.sub(r"<.*", "", name)
    return name.rsplit("::", 1)[-1][:60]


def launch_groups(events: list[dict], gap_us: float) -> list[list[dict]]:
    """Events cut wherever the device idled longer than `gap_us` between one's end and the next one's start."""
    groups: list[list[dict]] = []
    end = None
    for event in events:
        if end is None or event["ts"] - end > gap_us:
            groups.append([])
        groups[-1].append(event)
        end = max(end or event["ts"], event["ts"] + event["dur"])
    return groups


def summary(group: list[dict]) -> dict:
    """Kernel count, span (first start to last end) and busy time in µs, and the kernels by name, most first."""
    span = max(e["ts"] + e["dur"] for e in group) - group[0]["ts"]
    counts = collections.Counter(short_name(e["name"]) for e in group)
    return {
        "kernels": len(group),
        "span_us": span,
        "busy_us": sum(e["dur"] for e in group),
        "names": dict(counts.most_common()),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a Chrome trace from torch.profiler (.json or .json.gz)")
    parser.add_argument("--skip", type=float, default=0.0, help="start at this fraction of the trace's time")
    parser.add_argument("--gap", type=float, default=3.0, help="idle µs that start a new launch group")
    parser.add_argument("--groups", type=int, default=12, help="how many groups to print")
    parser.add_argument("--show", type=int, default=None, help="print this group's kernels in order")
    args = parser.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        events = device_events(json.load(f))
    if not events:
        raise SystemExit(f"{args.trace}: no device kernels in this trace (a CPU-only profile?)")
    start, stop = events[0]["ts"], max(e["ts"] + e["dur"] for e in events)
    events = [e for e in events if e["ts"] >= start + args.skip * (stop - start)]
    groups = launch_groups(events, args.gap)
    rows = [summary(g) for g in groups]
    origin = events[0]["ts"]
    for index, (group, row) in enumerate(zip(groups, rows, strict=True)):
        if index >= args.groups and args.show is None:
            break
        names = ", ".join(f"{name} x{count}" for name, count in row["names"].items())
        if args.show is None:
            print(
                f"[{index}] at {group[0]['ts'] - origin:9.1f} µs: {row['kernels']:4d} kernels, span "
                f"{row['span_us']:8.1f} µs, busy {row['busy_us']:8.1f} | {names}"
            )
    if args.show is not None:
        group = groups[args.show]
        for event in group:
            print(f"{event['ts'] - group[0]['ts']:9.1f} {event['dur']:6.1f}  {short_name(event['name'])}")
    return rows


if __name__ == "__main__":
    main()
