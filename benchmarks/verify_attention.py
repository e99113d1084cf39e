"""One layer of tree-verify attention at Llama-3.1-8B shapes: our hybrid path vs the alternatives vs the floors.

    PYTHONPATH=. python benchmarks/verify_attention.py [--contexts 8192 32768 131072] [--tree 74] [--sweep]

Per context it checks every variant against a float32 reference, then times (CUDA events, L2 flushed before
each run, median of --iters CUDA-graph replays after --warmup; the hybrid is also timed without a graph):
- hybrid (ours): `hybrid_attention(backend="triton")` = fused_mask_attn over the tree tokens + the split-KV
  kernel over the cache, whose reduce merges the tree part in (three kernels); both parts are also timed alone;
- torch flash + eager tree: PyTorch's flash kernel over the cache (GQA folded into the query axis) + a plain
  PyTorch masked attention over the tree tokens + the LSE merge;
- eager masked: one HF-eager-style attention (repeat_kv, bf16 matmuls, fp32 softmax) over [cache ++ tree];
- KV-read floor: bytes of K+V read once / 4.3 TB/s; compute floor: 4*H*Tq*Tk*D FLOPs / 754 TFLOP/s (the
  measured bf16 matmul ceiling of the H200). With ~300 query rows per kv head this shape does ~300
  FLOP per byte of K/V, above the H200's ridge point, so the compute floor is the larger one.
--sweep also times the split-KV cache part over launch configurations (the default comes from this).
Prints a markdown table last; writes JSON to $OUT/verify_attention.json when OUT is set, else to --json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys

import torch

from longspec.infer.policy import DEFAULT_TREE_WIDTHS
from longspec.kernels.fused_mask_attn import fused_mask_attn, fused_mask_attn_naive
from longspec.kernels.split_kv_attn import split_kv_attn
from longspec.kernels.split_kv_attn.triton import default_config
from longspec.modules.attention import cache_attention, hybrid_attention, math_attention, merge_attention
from longspec.provenance import run_info

HBM_BYTES_PER_S = 4.3e12
MATMUL_FLOPS_PER_S = 754e12
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


def beam_tree(num_nodes: int, widths=DEFAULT_TREE_WIDTHS) -> list[int]:
    """Parents of the drafter's tree (1 root + levels of `widths`), extended by leaves off random nodes."""
    parents, prev = [-1], [0]
    for w in widths:
        level = list(range(len(parents), len(parents) + w))
        parents += [prev[i % len(prev)] for i in range(w)]
        prev = level
    g = torch.Generator().manual_seed(0)
    parents += [int(torch.randint(0, i, (1,), generator=g)) for i in range(len(parents), num_nodes)]
    return parents[:num_nodes]


def ancestor_mask(parents: list[int], device) -> torch.Tensor:
    """[T, T] ancestor-or-self mask, stored with rows padded to 16 bytes (as an engine that reuses one mask for
    every layer would allocate it) so the kernels read it in place (longspec.kernels.online_softmax)."""
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    padded = torch.zeros(T, -(-T // 16) * 16, dtype=torch.bool, device=device)
    padded[:, :T] = mask.to(device)
    return padded[:, :T]


def eager_masked(q, k, v, bias, scale):
    """HF eager attention: repeat K/V to all heads, bf16 matmuls, additive mask, softmax in fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale + bias
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def graphed(fn):
    """Capture fn in a CUDA graph (as an engine would) so timings measure the GPU, not Python launch overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile / autotune / allocate outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_ms(fn, *, iters: int, warmup: int, flush: torch.Tensor, graph: bool = True) -> float:
    """Median over `iters` of one call (replayed from a CUDA graph unless graph=False), each after evicting L2
    (so an 8K cache is not served from L2)."""
    fn = graphed(fn) if graph else fn
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def max_err(out, ref) -> float:
    return (out.float() - ref.float()).abs().max().item()


def bench_context(context: int, num_tree: int, args, flush) -> dict:
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    scale = HEAD_DIM**-0.5
    torch.manual_seed(0)
    # A static cache with room for the tree: the tree's K/V are written at [context, context + T) as an engine
    # would, so the eager baseline reads [cache ++ tree] as one contiguous prefix.
    k_cache = torch.randn(1, NUM_KV_HEADS, context + num_tree, HEAD_DIM, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(1, NUM_HEADS, num_tree, HEAD_DIM, device=dev, dtype=dtype)
    k_new, v_new = k_cache[:, :, context:], v_cache[:, :, context:]
    tree = ancestor_mask(beam_tree(num_tree), dev)
    full_mask = torch.cat([torch.ones(num_tree, context, dtype=torch.bool, device=dev), tree], dim=1)
    bias = torch.zeros(full_mask.shape, device=dev, dtype=dtype).masked_fill(~full_mask, float("-inf"))
    k_all, v_all = k_cache, v_cache  # [cache ++ tree]

    def ours():
        return hybrid_attention(
            q, k_new, v_new, k_cache, v_cache, context, tree, scale=scale, backend="triton"
        )

    def torch_flash_plus_eager_tree():
        out_c, lse_c = cache_attention(q, k_cache, v_cache, context, scale=scale, backend="torch_flash")
        out_t, lse_t = math_attention(q, k_new, v_new, tree, scale)
        return merge_attention(out_c, lse_c, out_t, lse_t)

    def eager():
        return eager_masked(q, k_all, v_all, bias, scale)

    def ours_cache_part():
        return split_kv_attn(q, k_cache, v_cache, context, scale)

    def ours_tree_part():
        return fused_mask_attn(q, k_new, v_new, tree, scale)

    # Correctness first, against float32.
    ref_out, ref_lse = fused_mask_attn_naive(q, k_all, v_all, full_mask, scale)
    checks = {}
    for name, fn in [("hybrid", ours), ("torch_flash+eager_tree", torch_flash_plus_eager_tree)]:
        out, lse = fn()
        checks[name] = {"out_max_err": max_err(out, ref_out), "lse_max_err": max_err(lse, ref_lse)}
    checks["eager"] = {"out_max_err": max_err(eager(), ref_out)}
    del ref_out, ref_lse
    ok = all(c["out_max_err"] < 2e-2 and c.get("lse_max_err", 0.0) < 1e-2 for c in checks.values())

    timing = dict(iters=args.iters, warmup=args.warmup, flush=flush)
    row = {
        "context": context,
        "tree_tokens": num_tree,
        "correct": ok,
        "checks": checks,
        "hybrid_ms": time_ms(ours, **timing),
        "hybrid_cache_part_ms": time_ms(ours_cache_part, **timing),
        "hybrid_tree_part_ms": time_ms(ours_tree_part, **timing),
        "torch_flash_eager_tree_ms": time_ms(torch_flash_plus_eager_tree, **timing),
        "eager_ms": time_ms(eager, **timing),
        "hybrid_no_graph_ms": time_ms(ours, **timing, graph=False),
        "config": default_config(NUM_HEADS // NUM_KV_HEADS * num_tree, NUM_KV_HEADS, context, HEAD_DIM, dev),
    }
    num_keys = context + num_tree
    row["kv_floor_ms"] = 2 * NUM_KV_HEADS * num_keys * HEAD_DIM * 2 / HBM_BYTES_PER_S * 1e3
    row["compute_floor_ms"] = 4 * NUM_HEADS * num_tree * num_keys * HEAD_DIM / MATMUL_FLOPS_PER_S * 1e3
    if args.sweep:
        row["sweep"] = sweep(q, k_cache, v_cache, context, scale, flush)
    return row


def sweep(q, k_cache, v_cache, context, scale, flush) -> list[dict]:
    """Time the split-KV kernel (cache part) over launch configurations, fastest first."""
    results = []
    # (BLOCK_M, BLOCK_N, num_warps, num_stages): the feasible corner of the space at head dim 128 on Hopper.
    grid = [
        (64, 32, 4, 3), (64, 32, 4, 4), (64, 32, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 3),
        (64, 128, 4, 2), (64, 128, 8, 2), (128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2),
    ]  # fmt: skip
    for block_m, block_n, num_warps, num_stages in grid:
        for num_splits in (2, 4, 6, 8, 13, 16, 26, 33, 52):
            if num_splits * 2 * block_n > context:
                continue
            config = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
                          num_splits=num_splits)  # fmt: skip
            try:
                run = functools.partial(split_kv_attn, q, k_cache, v_cache, context, scale, config=config)
                ms = time_ms(run, iters=10, warmup=2, flush=flush)
            except Exception as e:  # noqa: BLE001 - an infeasible config (out of resources) is skipped
                print(f"  skip {config}: {type(e).__name__}", flush=True)
                break
            results.append({**config, "ms": ms})
    results.sort(key=lambda r: r["ms"])
    for r in results[:8]:
        print(f"  sweep ctx={context}: {r}", flush=True)
    return results[:20]


def markdown(rows: list[dict]) -> str:
    lines = [
        "| context | tree | hybrid (ours) | ours: cache only / tree only | torch flash + eager tree | eager masked "
        "| KV-read floor | compute floor | hybrid / KV floor | hybrid / max floor | hybrid, no graph "
        "| best swept cache-part config |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        floor = max(r["kv_floor_ms"], r["compute_floor_ms"])
        best = "-"
        if r.get("sweep"):
            b = r["sweep"][0]
            best = f"{b['ms']:.3f} ms: M{b['BLOCK_M']} N{b['BLOCK_N']} w{b['num_warps']} s{b['num_stages']} x{b['num_splits']}"
        lines.append(
            f"| {r['context'] // 1024}K | {r['tree_tokens']} | {r['hybrid_ms']:.3f} ms "
            f"| {r['hybrid_cache_part_ms']:.3f} / {r['hybrid_tree_part_ms']:.3f} "
            f"| {r['torch_flash_eager_tree_ms']:.3f} | {r['eager_ms']:.3f} | {r['kv_floor_ms']:.3f} "
            f"| {r['compute_floor_ms']:.3f} | {r['hybrid_ms'] / r['kv_floor_ms']:.2f}x "
            f"| {r['hybrid_ms'] / floor:.2f}x | {r['hybrid_no_graph_ms']:.3f} | {best} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--tree", type=int, nargs="+", default=[74], help="tree tokens per verify step")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="also sweep split-KV launch configurations")
    parser.add_argument("--json", default="verify_attention.json", help="JSON path when $OUT is not set")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("verify_attention: needs a CUDA GPU", file=sys.stderr)
        return 2

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # > the 50 MB L2
    rows = []
    for context, num_tree in itertools.product(args.contexts, args.tree):
        row = bench_context(context, num_tree, args, flush)
        print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()

    meta = run_info(argv=argv)
    table = markdown(rows)
    path = os.path.join(os.environ["OUT"], "verify_attention.json") if os.environ.get("OUT") else args.json
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows, "table": table}, f, indent=1)
    print(f"\n{meta}\n\n{table}")
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
