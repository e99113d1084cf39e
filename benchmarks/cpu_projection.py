"""The decode step's projections on the CPU: F.linear against the weight-left GEMM (`modules.cpu_projection`),
per weight shape and row count, each call timed from cold caches as the engine's route choice times it.

    PYTHONPATH=. python benchmarks/cpu_projection.py                          # code target + SmolLM2 shapes
    PYTHONPATH=. python benchmarks/cpu_projection.py --shapes smollm2 --rows 1 2 3 --threads 1

Rows: 1 is an AR step, 2-17 a verified chain or tree. Prints a markdown table (µs per call, median of --reps cold
calls) with the route the engine would keep (weight-left only where it is >= MARGIN faster); writes JSON to
$OUT/cpu_projection.json when OUT is set, else to --json.
"""

from __future__ import annotations

import argparse
import os

import torch

from longspec.atomic import write_json_atomic
from longspec.modules import cpu_projection
from longspec.provenance import run_info

# shape: {projection: (in K, out N)}; the packed projections the target runs (qkv, gate_up) and the LM head
SHAPES = {
    "code_target": {"qkv": (256, 384), "o": (256, 256), "gate_up": (256, 1280), "down": (640, 256),
                    "lm_head": (256, 8192)},
    "smollm2": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
                "lm_head": (576, 49152)},
}  # fmt: skip


@torch.no_grad()  # the engine's routes are for inference (a global switch would leak into the caller)
def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 5, 9, 16])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default="cpu_projection.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    records = []
    for shape in args.shapes:
        for name, (k, n) in SHAPES[shape].items():
            weight = torch.randn(n, k, generator=generator)
            for rows in args.rows:
                x = torch.randn(rows, k, generator=generator)
                # the same product both ways (float32 sums in another order: last bits only)
                diff = (cpu_projection._run("weight_left", x, weight, None) - x @ weight.T).abs().max().item()
                us = {
                    route: 1e6
                    * cpu_projection._median_seconds(
                        route, lambda r=route, x=x, w=weight: cpu_projection._run(r, x, w, None), args.reps
                    )
                    for route in cpu_projection.ROUTES
                }
                keep = cpu_projection.faster_route(us)  # the engine's rule
                records.append(
                    {"shape": shape, "projection": name, "in": k, "out": n, "rows": rows,
                     "linear_us": us["linear"], "weight_left_us": us["weight_left"], "kept": keep, "max_abs_diff": diff}
                )  # fmt: skip
                print(
                    f"{shape} {name} rows {rows}: F.linear {us['linear']:.0f} µs, weight-left "
                    f"{us['weight_left']:.0f} µs -> {keep}",
                    flush=True,
                )
    print(f"\ntorch threads {torch.get_num_threads()}; µs per call, median of {args.reps} cold calls\n")
    print("| shape | projection | rows | F.linear | weight-left | kept |")
    print("|---|---|---|---|---|---|")
    for r in records:
        print(
            f"| {r['shape']} | {r['projection']} | {r['rows']} | {r['linear_us']:.0f} | "
            f"{r['weight_left_us']:.0f} | {r['kept']} |"
        )
    out = os.path.join(os.environ["OUT"], "cpu_projection.json") if os.environ.get("OUT") else args.json
    write_json_atomic(
        out,
        {
            **run_info(device="cpu", argv=argv),
            "args": vars(args),
            "threads": torch.get_num_threads(),
            "rows": records,
        },
    )
    return records


if __name__ == "__main__":
    main()
