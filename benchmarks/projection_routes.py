"""The decode step's projections (few rows x a layer's weight) by weight layout, at a real model's shape.

    PYTHONPATH=. python benchmarks/projection_routes.py                    # CUDA, bf16: every real shape below
    PYTHONPATH=. python benchmarks/projection_routes.py --shapes 8b --rows 1 5
    PYTHONPATH=. python benchmarks/projection_routes.py --tiny             # CPU smoke test

An AR step multiplies one row by each weight; cuBLAS picks its kernel by shape and layout, and at one row some
picks stream the weight well below the bytes rate or add a split-K reduce launch. Routes:
- `linear`: `F.linear(x, W)`, W [N, K] as HF stores it (what the target runs past 2 rows, and in float32);
- `transposed`: `x @ Wt`, Wt [K, N] contiguous (the same product, the other layout);
- `gemv` (CUDA, 1-2 rows): `kernels.gemv`, what the target runs there in 16-bit dtypes. With --sweep, also the
  best of a grid of its (BLOCK_N, BLOCK_K, num_warps), recorded with its config. For the gate/up
  projection also the MLP's first half both ways: `linear + silu_mul` (cuBLAS, then the fused element-wise
  kernel) against `gemv_silu_mul` (one launch). For an LM head also the greedy pick both ways: `linear + argmax`
  (cuBLAS, then `kernels.row_argmax`) against `head_argmax` (one launch, the logits never written; with --sweep
  the best of its grid too).
Per projection, one call per layer over that many layers' own weights (so nothing is served from L2 that a
real step would read from HBM), captured in one CUDA graph and timed by CUDA events (median of --iters replays);
µs per call against the bytes floor (the weight read once at 4.3 TB/s). The routes' outputs are checked against
each other first (max abs difference, recorded). Prints a table; writes $OUT/projection_routes.json (or --json).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from longspec.atomic import write_json_atomic
from longspec.kernels import gemv as gemv_kernels
from longspec.modules.layer_ops import silu_mul
from longspec.provenance import run_info

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from split_kv_sweep import _graph_timer  # noqa: E402  (the same graph-replay timer as the split sweep)

HBM_BYTES_PER_S = 4.3e12

# shape: (layers, {projection: (in K, out N)})
SHAPES = {
    "8b": (
        32,
        {
            "qkv": (4096, 6144),
            "o": (4096, 4096),
            "gate_up": (4096, 28672),
            "down": (14336, 4096),
            "lm_head": (4096, 128256),
            "draft_head_32k": (4096, 32768),
        },
    ),
    "smollm2": (
        30,
        {
            "qkv": (576, 960),
            "o": (576, 576),
            "gate_up": (576, 3072),
            "down": (1536, 576),
            "lm_head": (576, 49152),
            "draft_head_8k": (576, 8192),
            "draft_head_32k": (576, 32768),
        },
    ),
    "qwen25_coder_05b": (
        24,
        {
            "qkv": (896, 1152),
            "o": (896, 896),
            "gate_up": (896, 9728),
            "down": (4864, 896),
            "lm_head": (896, 151936),
            "draft_head_8k": (896, 8192),
            "draft_head_32k": (896, 32768),
        },
    ),
    "tiny": (2, {"qkv": (64, 96), "down": (128, 64)}),
}
ROUTES = {
    "linear": lambda x, w, wt: F.linear(x, w),
    "transposed": lambda x, w, wt: x @ wt,
}


GEMV_SWEEP = [
    {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w} for bn in (2, 4, 8) for bk in (256, 512) for w in (4, 8)
]
PICK_SWEEP = [
    {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
    for bn in (4, 8, 16, 32)
    for bk in (128, 256, 512)
    for w in (4, 8)
]


def time_projection(
    layers: int, k: int, n: int, rows: int, iters: int, device, dtype, sweep=False, gate_up=False, head=False
) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    # One weight per layer, at most ~4 GiB in all (the LM head is one weight, not per layer: a few copies are
    # enough to keep every call's read from HBM).
    layers = max(2, min(layers, (1 << 32) // (n * k * dtype.itemsize)))
    weights = [torch.randn(n, k, generator=gen, device=device, dtype=dtype) / k**0.5 for _ in range(layers)]
    transposed = [w.t().contiguous() for w in weights]
    x = torch.randn(rows, k, generator=gen, device=device, dtype=dtype)
    row = {"rows": rows, "in": k, "out": n, "floor_us": n * k * dtype.itemsize / HBM_BYTES_PER_S * 1e6}
    reference = F.linear(x, weights[0]).float()
    row["max_abs_diff"] = max(
        float((route(x, weights[0], transposed[0]).float() - reference).abs().max())
        for route in ROUTES.values()
    )

    def timed(route) -> float:
        return _graph_timer(lambda: [route(w, wt) for w, wt in zip(weights, transposed, strict=True)], iters)

    for name, route in ROUTES.items():
        row[f"{name}_us"] = timed(lambda w, wt, route=route: route(x, w, wt)) * 1e3 / layers
    if device.type == "cuda" and rows <= gemv_kernels.MAX_ROWS:
        from longspec.kernels.gemv import gemv, gemv_silu_mul

        row["gemv_max_abs_diff"] = float((gemv(x, weights[0]).float() - reference).abs().max())
        row["gemv_us"] = timed(lambda w, wt: gemv(x, w)) * 1e3 / layers
        if sweep:
            row["sweep_best_us"], row["sweep_best_config"] = min(
                ((timed(lambda w, wt, c=c: gemv(x, w, config=c)) * 1e3 / layers, c) for c in GEMV_SWEEP),
                key=lambda t: t[0],
            )
        if gate_up:  # the gate/up weight: the MLP's first half, F.linear + silu_mul vs the fused GEMV
            row["linear_silu_mul_us"] = timed(lambda w, wt: silu_mul(F.linear(x, w))) * 1e3 / layers
            row["gemv_silu_mul_us"] = timed(lambda w, wt: gemv_silu_mul(x, w)) * 1e3 / layers
            if sweep:
                row["silu_sweep_best_us"], row["silu_sweep_best_config"] = min(
                    (
                        (timed(lambda w, wt, c=c: gemv_silu_mul(x, w, config=c)) * 1e3 / layers, c)
                        for c in GEMV_SWEEP
                    ),
                    key=lambda t: t[0],
                )
        if head:  # the greedy pick: F.linear + row_argmax vs head_argmax, checked to agree first
            from longspec.kernels.head_argmax import head_argmax_triton
            from longspec.kernels.row_argmax import row_argmax

            row["pick_matches"] = bool(torch.equal(head_argmax_triton(x, weights[0]), row_argmax(reference)))
            row["linear_argmax_us"] = timed(lambda w, wt: row_argmax(F.linear(x, w))) * 1e3 / layers
            row["head_argmax_us"] = timed(lambda w, wt: head_argmax_triton(x, w)) * 1e3 / layers
            if sweep:
                row["pick_sweep_best_us"], row["pick_sweep_best_config"] = min(
                    ((timed(lambda w, wt, c=c: head_argmax_triton(x, w, config=c)) * 1e3 / layers, c)
                     for c in PICK_SWEEP),
                    key=lambda t: t[0],
                )  # fmt: skip
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    real = [name for name in SHAPES if name != "tiny"]
    parser.add_argument("--shapes", nargs="+", default=real, choices=real)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 69])
    parser.add_argument(
        "--projections", nargs="+", default=None, help="only these projections (e.g. lm_head draft_head_32k)"
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also the best GEMV configs of a grid")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU, float32")
    parser.add_argument("--json", default="projection_routes.json", help="output path when $OUT is not set")
    args = parser.parse_args(argv)
    if args.tiny:
        device, dtype, shapes = torch.device("cpu"), torch.float32, ["tiny"]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("projection_routes needs a CUDA GPU (or --tiny for the CPU smoke test)")
        device, dtype, shapes = torch.device("cuda"), torch.bfloat16, args.shapes
    rows_out = []
    print(
        "| shape | projection | rows | floor µs | "
        + " | ".join(f"{r} µs" for r in ROUTES)
        + " | max abs diff |"
    )
    print("|---|---|---|---|" + "---|" * len(ROUTES) + "---|")
    for shape in shapes:
        layers, projections = SHAPES[shape]
        for name, (k, n) in projections.items():
            if args.projections and name not in args.projections:
                continue
            for rows in args.rows:
                row = {
                    "shape": shape,
                    "projection": name,
                    **time_projection(
                        layers,
                        k,
                        n,
                        rows,
                        args.iters,
                        device,
                        dtype,
                        args.sweep,
                        gate_up=name == "gate_up",
                        head="head" in name,
                    ),  # fmt: skip
                }
                rows_out.append(row)
                times = " | ".join(f"{row[f'{r}_us']:.2f}" for r in ROUTES)
                extra = ""
                if "gemv_us" in row:
                    extra = f" gemv {row['gemv_us']:.2f} µs"
                if "sweep_best_us" in row:
                    extra += f" (sweep best {row['sweep_best_us']:.2f} µs {row['sweep_best_config']})"
                if "gemv_silu_mul_us" in row:
                    extra += (f"; as gate/up: linear + silu_mul {row['linear_silu_mul_us']:.2f} µs,"
                              f" gemv_silu_mul {row['gemv_silu_mul_us']:.2f} µs")  # fmt: skip
                if "head_argmax_us" in row:
                    extra += (f"; greedy pick: linear + argmax {row['linear_argmax_us']:.2f} µs, head_argmax "
                              f"{row['head_argmax_us']:.2f} µs (same pick: {row['pick_matches']})")  # fmt: skip
                if "pick_sweep_best_us" in row:
                    extra += (
                        f" (sweep best {row['pick_sweep_best_us']:.2f} µs {row['pick_sweep_best_config']})"
                    )
                if "silu_sweep_best_us" in row:
                    extra += (
                        f" (sweep best {row['silu_sweep_best_us']:.2f} µs {row['silu_sweep_best_config']})"
                    )
                print(f"| {shape} | {name} | {rows} | {row['floor_us']:.2f} | {times} | {row['max_abs_diff']:.3g} |"
                      f"{extra}", flush=True)  # fmt: skip
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    out = os.path.join(os.environ["OUT"], "projection_routes.json") if os.environ.get("OUT") else args.json
    write_json_atomic(out, {**run_info(), "args": vars(args), "rows": rows_out})
    return rows_out


if __name__ == "__main__":
    main()
