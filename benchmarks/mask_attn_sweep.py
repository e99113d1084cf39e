"""Launch parameters of the masked attention kernel (`longspec.kernels.fused_mask_attn`) in the cases that run it:
the drafter's self-attention over its ring buffer and the draft's nodes (a chain's one query, a tree level's
queries) and the verify's tree part, at the SmolLM2, Qwen2.5-Coder-0.5B and 8B shapes.

    PYTHONPATH=. python benchmarks/mask_attn_sweep.py                      # CUDA, bf16: every case below
    PYTHONPATH=. python benchmarks/mask_attn_sweep.py --cases qwen_ring_chain
    PYTHONPATH=. python benchmarks/mask_attn_sweep.py --tiny               # CPU smoke test (Triton's interpreter)

Per case, --calls calls over that many distinct K/V buffers (so nothing is served from L2 that a draft step would
read from HBM), captured in one CUDA graph and timed by CUDA events (median of --iters replays), reported per call:
the kernel's default (block_n, num_warps) and each of the grid, with each output checked against the default's
(max abs difference). Prints a line per case and writes $OUT/mask_attn_sweep.json (or --json).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

from longspec.atomic import write_json_atomic
from longspec.provenance import run_info

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # split_kv_sweep.py beside it
from split_kv_sweep import _graph_timer, sweep_setup  # noqa: E402

# name: (batch, query heads, kv heads, head dim, queries, keys). A ring of 512 slots (the default window) plus the
# draft's nodes so far; the verify's tree part is the round's nodes against themselves.
CASES = {
    "smollm2_ring_chain": (1, 9, 3, 64, 1, 513),
    "smollm2_ring_level16": (1, 9, 3, 64, 16, 512 + 37),
    "qwen_ring_chain": (1, 14, 2, 64, 1, 513),
    "qwen_ring_level16": (1, 14, 2, 64, 16, 512 + 53),
    "8b_ring_chain": (1, 32, 8, 128, 1, 513),
    "8b_ring_chain_b8": (8, 32, 8, 128, 1, 513),
    "smollm2_verify_chain2": (1, 9, 3, 64, 2, 2),
    "smollm2_verify_tree69": (1, 9, 3, 64, 69, 69),
    "8b_verify_tree69": (1, 32, 8, 128, 69, 69),
}
TINY = {"tiny_ring_chain": (1, 4, 2, 16, 1, 40), "tiny_verify_tree": (2, 4, 2, 16, 7, 7)}


def sweep_case(name: str, shape: tuple, grid: list[tuple[int, int]], calls: int, iters: int, device, dtype):
    from longspec.kernels.fused_mask_attn.triton import fused_mask_attn

    B, H, Hkv, D, Tq, Tk = shape
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        return torch.randn(*size, generator=generator, device=device, dtype=dtype)

    kvs = [(rand(B, Hkv, Tk, D), rand(B, Hkv, Tk, D)) for _ in range(calls)]
    q = rand(B, H, Tq, D)
    # A ring mostly visible (a window's worth), the nodes causal among themselves: the drafter's pattern.
    mask = torch.rand(B, Tq, Tk, generator=generator, device=device) < 0.9
    mask[:, :, Tk - Tq :] = torch.ones(Tq, Tq, dtype=torch.bool, device=device).tril()

    def run(config):
        return [fused_mask_attn(q, k, v, mask, **config)[0] for k, v in kvs]

    reference = run({})[0].float()
    row = {"case": name, "shape": shape, "default_ms": _graph_timer(lambda: run({}), iters) / calls}
    row["ms_by_config"], row["max_abs_diff"] = {}, 0.0
    row["too_large"] = []  # configurations the device cannot launch (shared memory at head dim 128)
    for block_n, num_warps in grid:
        config = {"block_n": block_n, "num_warps": num_warps}
        try:
            diff = float((run(config)[0].float() - reference).abs().max())
        except Exception as exc:  # triton's OutOfResources
            if type(exc).__name__ != "OutOfResources":
                raise
            row["too_large"].append(f"{block_n}x{num_warps}")
            continue
        row["max_abs_diff"] = max(row["max_abs_diff"], diff)
        ms = _graph_timer(lambda config=config: run(config), iters) / calls
        row["ms_by_config"][f"{block_n}x{num_warps}"] = ms
    best = min(row["ms_by_config"], key=row["ms_by_config"].get)
    row["best"], row["best_ms"] = best, row["ms_by_config"][best]
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=None, help=f"some of: {' '.join(CASES)}")
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--num-warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--tiny", action="store_true", help="tiny cases on the CPU, Triton's interpreter")
    parser.add_argument("--json", default="mask_attn_sweep.json", help="output path when $OUT is not set")
    args = parser.parse_args(argv)
    device, dtype, cases, names = sweep_setup(parser, args, "mask_attn_sweep", CASES, TINY)
    grid = list(itertools.product(args.block_n, args.num_warps))
    rows = []
    for name in names:
        row = sweep_case(name, cases[name], grid, args.calls, args.iters, device, dtype)
        table = " ".join(f"{c}:{ms * 1e3:.1f}" for c, ms in row["ms_by_config"].items())
        print(
            f"{name}: default {row['default_ms'] * 1e3:.1f} us, best ({row['best']}) {row['best_ms'] * 1e3:.1f} us"
            f" per call, max abs diff {row['max_abs_diff']:.2e} | {table}",
            flush=True,
        )
        rows.append(row)
    out = os.path.join(os.environ["OUT"], "mask_attn_sweep.json") if os.environ.get("OUT") else args.json
    write_json_atomic(out, {**run_info(), "args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
