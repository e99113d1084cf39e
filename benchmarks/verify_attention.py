"""One layer of tree-verify attention at Llama-3.1-8B shapes: our hybrid path vs the alternatives vs the floors.

    PYTHONPATH=. python benchmarks/verify_attention.py [--contexts 8192 32768 131072] [--tree 74] [--sweep]
    PYTHONPATH=. python benchmarks/verify_attention.py --batch 8 --ragged [--contexts 8192 32768]

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
--batch N --ragged times instead a batch of N sequences with different cache lengths (spread over
[context/4, context], the longest = context; the cache is allocated for the longest) and one tree per sequence:
one ragged launch (`hybrid_attention` with lengths [N] and masks [N, T, T] on the device) vs N separate
batch-of-one calls, both replayed from CUDA graphs, with the batch's KV-read floor. The batch is checked row by
row against a float32 reference first (`check_ragged`, which the CPU tests run at tiny shapes).
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

from longspec.atomic import write_json_atomic
from longspec.infer.candidates import DEFAULT_TREE_WIDTHS
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


def ragged_lengths(batch: int, context: int) -> list[int]:
    """Cache lengths of a ragged batch: from `context` down to about context/4, not multiples of a tile."""
    step = 3 * context // 4 // max(1, batch - 1)
    return [max(0, context - i * step - 13 * i) for i in range(batch)]


def ragged_inputs(batch, context, num_tree, device, dtype, heads=(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)):
    """q, new K/V, a cache allocated for the longest row, per-row lengths [B] int32 and trees [B, T, T]."""
    num_heads, num_kv_heads, head_dim = heads
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)  # the trees
    lengths = ragged_lengths(batch, context)
    k_cache = torch.randn(batch, num_kv_heads, context, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    for b, n in enumerate(lengths):  # past its length a row's slots hold another sequence's garbage
        k_cache[b, :, n:] = float("nan")
        v_cache[b, :, n:] = float("nan")
    q = torch.randn(batch, num_heads, num_tree, head_dim, device=device, dtype=dtype)
    k_new = torch.randn(batch, num_kv_heads, num_tree, head_dim, device=device, dtype=dtype)
    v_new = torch.randn_like(k_new)
    trees = [beam_tree(num_tree)] + [  # row 0 the drafter's tree, the others random trees of the same size
        [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, num_tree)]
        for _ in range(batch - 1)
    ]
    padded = torch.zeros(batch, num_tree, -(-num_tree // 16) * 16, dtype=torch.bool, device=device)
    for b, parents in enumerate(trees):
        padded[b, :, :num_tree] = ancestor_mask(parents, device)
    lengths_t = torch.tensor(lengths, dtype=torch.int32, device=device)
    return q, k_new, v_new, k_cache, v_cache, lengths_t, padded[:, :, :num_tree]


def check_ragged(inputs, scale) -> dict:
    """Max errors of the ragged launch vs a float32 masked attention over [cache[:n_b] ++ tree_b], row by row,
    and of the N separate calls vs the ragged launch (they must agree: the batched engine relies on it)."""
    q, k_new, v_new, k_cache, v_cache, lengths, masks = inputs
    out, lse = hybrid_attention(
        q, k_new, v_new, k_cache, v_cache, lengths, masks, scale=scale, backend="triton"
    )
    errs = {"out_max_err": 0.0, "lse_max_err": 0.0, "separate_vs_batch_max_err": 0.0}
    for b, n in enumerate(lengths.tolist()):
        row = slice(b, b + 1)
        keys = torch.cat([k_cache[row, :, :n], k_new[row]], dim=2)
        values = torch.cat([v_cache[row, :, :n], v_new[row]], dim=2)
        full = torch.cat([torch.ones(q.shape[2], n, dtype=torch.bool, device=q.device), masks[b]], dim=1)
        ref_out, ref_lse = fused_mask_attn_naive(q[row], keys, values, full, scale)
        errs["out_max_err"] = max(errs["out_max_err"], max_err(out[row], ref_out))
        errs["lse_max_err"] = max(errs["lse_max_err"], max_err(lse[row], ref_lse))
        alone, _ = hybrid_attention(q[row], k_new[row], v_new[row], k_cache[row], v_cache[row], lengths[row],
                                    masks[row], scale=scale, backend="triton")  # fmt: skip
        errs["separate_vs_batch_max_err"] = max(errs["separate_vs_batch_max_err"], max_err(alone, out[row]))
    return errs


def bench_ragged(context: int, num_tree: int, batch: int, args, flush) -> dict:
    dev, dtype, scale = torch.device("cuda"), torch.bfloat16, HEAD_DIM**-0.5
    inputs = ragged_inputs(batch, context, num_tree, dev, dtype)
    q, k_new, v_new, k_cache, v_cache, lengths, masks = inputs
    checks = check_ragged(inputs, scale)
    ok = (
        all(checks[k] < 2e-2 for k in ("out_max_err", "separate_vs_batch_max_err"))
        and checks["lse_max_err"] < 1e-2
    )

    def ragged():
        return hybrid_attention(
            q, k_new, v_new, k_cache, v_cache, lengths, masks, scale=scale, backend="triton"
        )

    def separate():
        for b in range(batch):
            row = slice(b, b + 1)
            hybrid_attention(q[row], k_new[row], v_new[row], k_cache[row], v_cache[row], lengths[row],
                             masks[row], scale=scale, backend="triton")  # fmt: skip

    timing = dict(iters=args.iters, warmup=args.warmup, flush=flush)
    num_keys = sum(ragged_lengths(batch, context)) + batch * num_tree
    return {
        "context": context,
        "batch": batch,
        "lengths": ragged_lengths(batch, context),
        "tree_tokens": num_tree,
        "correct": ok,
        "checks": checks,
        "ragged_ms": time_ms(ragged, **timing),
        "separate_ms": time_ms(separate, **timing),
        "kv_floor_ms": 2 * NUM_KV_HEADS * num_keys * HEAD_DIM * 2 / HBM_BYTES_PER_S * 1e3,
    }


def markdown_ragged(rows: list[dict]) -> str:
    lines = [
        "| context (longest) | batch | tree | ragged launch | N separate calls | separate / ragged | batch KV floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['context'] // 1024}K | {r['batch']} | {r['tree_tokens']} | {r['ragged_ms']:.3f} ms "
            f"| {r['separate_ms']:.3f} ms | {r['separate_ms'] / r['ragged_ms']:.2f}x | {r['kv_floor_ms']:.3f} ms |"
        )
    return "\n".join(lines)


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
    parser.add_argument("--contexts", type=int, nargs="+", help="default 8K 32K 128K; 8K 32K with --ragged")
    parser.add_argument("--tree", type=int, nargs="+", default=[74], help="tree tokens per verify step")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="also sweep split-KV launch configurations")
    parser.add_argument("--batch", type=int, default=1, help="sequences per launch (with --ragged)")
    parser.add_argument("--ragged", action="store_true", help="time a ragged batch vs --batch separate calls")
    parser.add_argument("--json", default="verify_attention.json", help="JSON path when $OUT is not set")
    args = parser.parse_args(argv)
    if args.batch < 1 or (args.batch > 1 and not args.ragged):
        parser.error("--batch N needs --ragged (and N >= 1)")
    if args.contexts is None:
        args.contexts = [8192, 32768] if args.ragged else [8192, 32768, 131072]
    if not torch.cuda.is_available():
        print("verify_attention: needs a CUDA GPU", file=sys.stderr)
        return 2

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # > the 50 MB L2
    rows = []
    for context, num_tree in itertools.product(args.contexts, args.tree):
        if args.ragged:
            row = bench_ragged(context, num_tree, args.batch, args, flush)
        else:
            row = bench_context(context, num_tree, args, flush)
        print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()

    meta = run_info(argv=argv)
    table = markdown_ragged(rows) if args.ragged else markdown(rows)
    path = os.path.join(os.environ["OUT"], "verify_attention.json") if os.environ.get("OUT") else args.json
    write_json_atomic(path, {"meta": meta, "rows": rows, "table": table})
    print(f"\n{meta}\n\n{table}")
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
