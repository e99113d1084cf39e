"""Ablation 3 (paper: hybrid tree attention cuts target attention per round 49.92 -> 12.54 ms, -75%), on one GPU.

    PYTHONPATH=. python benchmarks/ablations/tree_attention.py [--contexts 8192 16384 32768] [--kv-heads 8 32]

Target attention time of one verification round = layers x one layer's verify attention (the tree's queries
against [cache ++ tree]), timed per layer by benchmarks/verify_attention.py's `bench_context` (correctness
against fp32 first; CUDA events, L2 flushed, median of --iters CUDA-graph replays) at 7B/8B shapes: 32 layers,
32 query heads, head dim 128, --kv-heads 8 (Llama-3.1-8B, GQA) and 32 (Vicuna/LongChat-7B, the paper's targets),
bf16, the default draft tree (1 + 4 + 16 x 4 = 69 nodes). Variants:
- hybrid (ours): split-KV Triton over the cache + Triton fused_mask_attn over the tree, merged by LSE;
- torch flash + eager tree: PyTorch's flash kernel over the cache + plain PyTorch masked attention over the tree;
- eager masked: one HF-eager-style attention over [cache ++ tree] with a full [tree x (cache + tree)] mask
  (what the paper compares against).
Prints a table (per-round ms and the reduction vs eager); writes $OUT/tree_attention.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import verify_attention  # noqa: E402  (benchmarks/verify_attention.py)

from longspec.provenance import run_info  # noqa: E402

NUM_LAYERS = 32


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--tree", type=int, default=69, help="tree tokens per verify step")
    parser.add_argument("--layers", type=int, default=NUM_LAYERS)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", default="tree_attention.json", help="JSON path when $OUT is not set")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tree_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    bench_args = argparse.Namespace(iters=args.iters, warmup=args.warmup, sweep=False)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # > the 50 MB L2
    rows = []
    for kv_heads in args.kv_heads:
        # bench_context reads the head counts from module globals: set them per shape
        verify_attention.NUM_KV_HEADS = kv_heads
        for context in args.contexts:
            layer = verify_attention.bench_context(context, args.tree, bench_args, flush)
            row = {
                "kv_heads": kv_heads,
                "context": context,
                "tree": args.tree,
                "correct": layer["correct"],
                "per_round_ms": {
                    "hybrid": layer["hybrid_ms"] * args.layers,
                    "torch_flash_eager_tree": layer["torch_flash_eager_tree_ms"] * args.layers,
                    "eager_masked": layer["eager_ms"] * args.layers,
                },
                "layer": {k: v for k, v in layer.items() if k not in ("config",)},
            }
            print(json.dumps(row["per_round_ms"] | {"context": context, "kv_heads": kv_heads}), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()

    lines = [
        f"| shape (32 q heads, d 128, {args.layers} layers) | context | tree | hybrid (ours) | torch flash + eager tree "
        "| eager masked | hybrid vs eager | correct |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["per_round_ms"]
        shape = f"{'MHA' if r['kv_heads'] == 32 else 'GQA'} 32/{r['kv_heads']}"
        lines.append(
            f"| {shape} | {r['context'] // 1024}K "
            f"| {r['tree']} | {t['hybrid']:.2f} ms | {t['torch_flash_eager_tree']:.2f} ms | {t['eager_masked']:.2f} ms "
            f"| {t['hybrid'] / t['eager_masked'] - 1:+.0%} | {r['correct']} |"
        )
    table = "\n".join(lines)
    meta = run_info(argv=argv)
    path = os.path.join(os.environ["OUT"], "tree_attention.json") if os.environ.get("OUT") else args.json
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows, "table": table}, f, indent=1)
    print(f"\n{meta}\n\n{table}")
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
