"""The decode step's projections (few rows x a layer's weight) by weight layout, at a real model's shape.

    PYTHONPATH=. python benchmarks/projection_routes.py                    # CUDA, bf16: 8B and SmolLM2 shapes
    PYTHONPATH=. python benchmarks/projection_routes.py --shapes 8b --rows 1 5
    PYTHONPATH=. python benchmarks/projection_routes.py --tiny             # CPU smoke test

An AR step multiplies one row by each weight; cuBLAS picks its kernel by shape and layout, and at one row some
picks stream the weight well below the bytes rate or add a split-K reduce launch. Routes:
- `linear`: `F.linear(x, W)`, W [N, K] as HF stores it (what the target runs);
- `transposed`: `x @ Wt`, Wt [K, N] contiguous (the same product, the other layout);
- `partials` (CUDA, 1-2 rows; a candidate, not what the target runs): a Triton GEMV that streams [BLOCK_N,
  K / S] weight slices and writes S float32 partial sums [S, M, N], for a next fused element-wise step to add
  up (their sum is not timed here; cuBLAS's split-K runs a reduce launch of its own, which is). With --sweep,
  also the best of a grid of (BLOCK_N, BLOCK_K, S) at one row, recorded with its config.
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
from longspec.provenance import run_info

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from split_kv_sweep import _graph_timer  # noqa: E402  (the same graph-replay timer as the split sweep)

HBM_BYTES_PER_S = 4.3e12

# shape: (layers, {projection: (in K, out N)})
SHAPES = {
    "8b": (32, {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}),
    "smollm2": (30, {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}),
    "tiny": (2, {"qkv": (64, 96), "down": (128, 64)}),
}
ROUTES = {
    "linear": lambda x, w, wt: F.linear(x, w),
    "transposed": lambda x, w, wt: x @ wt,
}


def _partials_route():
    """The candidate GEMV (imports Triton): (x [M <= 2, K], w [N, K], config) -> partials [S, M, N] float32."""
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_partials(
        X, W, P, N, K, stride_xm, stride_wn, stride_ps, stride_pm,
        SPLIT_LEN: tl.constexpr, TWO_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # SPLIT_LEN a compile-time multiple of BLOCK_K: every tile's start known aligned, so the weight streams in
        # wide vector loads (a run-time split length ran ~1.6x slower at one row on an H200).
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        s = tl.program_id(1)
        n_ok = n < N
        start = s * SPLIT_LEN
        stop = tl.minimum(start + SPLIT_LEN, K)
        acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(start, stop, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < stop
            w = tl.load(
                W + n[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
            )
            w = w.to(tl.float32)
            acc0 += tl.sum(w * tl.load(X + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :], axis=1)
            if TWO_ROWS:
                acc1 += tl.sum(
                    w * tl.load(X + stride_xm + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :], axis=1
                )
        tl.store(P + s * stride_ps + n, acc0, mask=n_ok)
        if TWO_ROWS:
            tl.store(P + s * stride_ps + stride_pm + n, acc1, mask=n_ok)

    def run(x, w, config):
        rows, (n, k) = x.shape[0], w.shape
        assert rows <= 2 and x.stride(-1) == 1 and w.stride(-1) == 1
        block_n, block_k, splits = config["BLOCK_N"], config["BLOCK_K"], config["splits"]
        split_len = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
        partials = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
        gemv_partials[(triton.cdiv(n, block_n), splits)](
            x, w, partials, n, k, x.stride(0), w.stride(0), partials.stride(0), partials.stride(1),
            SPLIT_LEN=split_len, TWO_ROWS=rows == 2, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4,
        )  # fmt: skip
        return partials

    return run


PARTIALS_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 256, "splits": 4}
SPLITK_CONFIGS = [
    {"BLOCK_N": bn, "BLOCK_K": bk, "splits": s}
    for bn in (16, 32, 64)
    for bk in (128, 256)
    for s in (1, 2, 4, 8)
]


def time_projection(layers: int, k: int, n: int, rows: int, iters: int, device, dtype, sweep=False) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(n, k, generator=gen, device=device, dtype=dtype) / k**0.5 for _ in range(layers)]
    transposed = [w.t().contiguous() for w in weights]
    x = torch.randn(rows, k, generator=gen, device=device, dtype=dtype)
    row = {"rows": rows, "in": k, "out": n, "floor_us": n * k * dtype.itemsize / HBM_BYTES_PER_S * 1e6}
    reference = F.linear(x, weights[0]).float()
    row["max_abs_diff"] = max(
        float((route(x, weights[0], transposed[0]).float() - reference).abs().max())
        for route in ROUTES.values()
    )
    for name, route in ROUTES.items():

        def run(route=route):
            for w, wt in zip(weights, transposed, strict=True):
                route(x, w, wt)

        row[f"{name}_us"] = _graph_timer(run, iters) * 1e3 / layers
    if device.type == "cuda" and rows <= 2:
        partials = _partials_route()
        got = partials(x, weights[0], PARTIALS_CONFIG).sum(0)
        row["partials_max_abs_diff"] = float((got - reference).abs().max())

        def run_partials(config=PARTIALS_CONFIG):
            for w in weights:
                partials(x, w, config)

        row["partials_us"] = _graph_timer(run_partials, iters) * 1e3 / layers
        if sweep and rows == 1:
            timed = [
                (_graph_timer(lambda c=c: run_partials(c), iters) * 1e3 / layers, c) for c in SPLITK_CONFIGS
            ]
            row["sweep_best_us"], row["sweep_best_config"] = min(timed, key=lambda t: t[0])
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["8b", "smollm2"], choices=["8b", "smollm2"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 69])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also the best partials config at one row")
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
            for rows in args.rows:
                row = {
                    "shape": shape,
                    "projection": name,
                    **time_projection(layers, k, n, rows, args.iters, device, dtype, args.sweep),
                }
                rows_out.append(row)
                times = " | ".join(f"{row[f'{r}_us']:.2f}" for r in ROUTES)
                splitk = ""
                if "partials_us" in row:
                    splitk = f" partials {row['partials_us']:.2f} µs"
                if "sweep_best_us" in row:
                    splitk += f" (sweep best {row['sweep_best_us']:.2f} µs {row['sweep_best_config']})"
                print(f"| {shape} | {name} | {rows} | {row['floor_us']:.2f} | {times} | {row['max_abs_diff']:.3g} |"
                      f"{splitk}", flush=True)  # fmt: skip
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    out = os.path.join(os.environ["OUT"], "projection_routes.json") if os.environ.get("OUT") else args.json
    write_json_atomic(out, {**run_info(), "args": vars(args), "rows": rows_out})
    return rows_out


if __name__ == "__main__":
    main()
