"""Split count (and tiles) of the split-KV attention kernel (`longspec.kernels.split_kv_attn`) in the decode cases
that run it with few query rows: an AR step, a chain verify, a batch of them, at the 8B, SmolLM2 and
Qwen2.5-Coder-0.5B shapes.

    PYTHONPATH=. python benchmarks/split_kv_sweep.py                     # CUDA, bf16: every case below
    PYTHONPATH=. python benchmarks/split_kv_sweep.py --cases 8b_ar_b1    # some of them
    PYTHONPATH=. python benchmarks/split_kv_sweep.py --cases qwen05b_ar_b1_32k --tiles 64x64 16x128
    PYTHONPATH=. python benchmarks/split_kv_sweep.py --tiny              # CPU smoke test (Triton's interpreter)

Per case, one call per layer over that many layers' own random caches (a model's step reads every layer's cache
once, so nothing is served from L2 that a real step would read from HBM), captured in one CUDA graph and timed by
CUDA events (median of --iters replays): the kernel's default configuration (`default_config`) and each of
--splits, in the default's tiles or in each of --tiles (BLOCK_M x BLOCK_N: query rows x keys per tile), with the
output checked against the default's (max abs difference). The bytes floor is the caches' K/V read once
at 4.3 TB/s. Prints a line per case and writes $OUT/split_kv_sweep.json (or --json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from longspec.atomic import write_json_atomic
from longspec.provenance import run_info

HBM_BYTES_PER_S = 4.3e12

# name: (layers, batch, query heads, kv heads, head dim, queries per row, context)
CASES = {
    "8b_ar_b1_8k": (32, 1, 32, 8, 128, 1, 8192),
    "8b_ar_b1_32k": (32, 1, 32, 8, 128, 1, 32768),
    "8b_chain5_b1_8k": (32, 1, 32, 8, 128, 5, 8192),
    "8b_chain17_b1_8k": (32, 1, 32, 8, 128, 17, 8192),
    "8b_chain17_b1_32k": (32, 1, 32, 8, 128, 17, 32768),
    "8b_ar_b8_8k": (32, 8, 32, 8, 128, 1, 8192),
    "8b_ar_b8_32k": (32, 8, 32, 8, 128, 1, 32768),
    "8b_chain5_b8_32k": (32, 8, 32, 8, 128, 5, 32768),
    "8b_ar_b16_8k": (32, 16, 32, 8, 128, 1, 8192),
    "smollm2_ar_b1_4k": (30, 1, 9, 3, 64, 1, 4096),
    "smollm2_ar_b1_8k": (30, 1, 9, 3, 64, 1, 8192),
    "smollm2_chain5_b1_4k": (30, 1, 9, 3, 64, 5, 4096),
    "smollm2_chain17_b1_8k": (30, 1, 9, 3, 64, 17, 8192),
    "smollm2_ar_b16_4k": (30, 16, 9, 3, 64, 1, 4096),
    "qwen05b_ar_b1_8k": (24, 1, 14, 2, 64, 1, 8192),
    "qwen05b_ar_b1_32k": (24, 1, 14, 2, 64, 1, 32768),
    "qwen05b_chain2_b1_32k": (24, 1, 14, 2, 64, 2, 32768),
    "qwen05b_chain5_b1_32k": (24, 1, 14, 2, 64, 5, 32768),
}
TINY = {"tiny_ar_b2": (2, 2, 4, 2, 16, 1, 256), "tiny_chain3_b1": (2, 1, 4, 2, 16, 3, 256)}


def _graph_timer(fn, iters: int):
    """Median ms of fn replayed from a CUDA graph (eager wall time on the CPU)."""
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles every kernel before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sweep_setup(parser, args, script: str, cases: dict, tiny: dict):
    """(device, dtype, cases, the case names to run) of a kernel sweep's command line: bf16 cases on CUDA, or with
    --tiny the tiny ones in float32 on Triton's CPU interpreter; an unknown --cases name is a usage error."""
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel module is first imported
        device, dtype, cases = torch.device("cpu"), torch.float32, tiny
    else:
        if not torch.cuda.is_available():
            raise SystemExit(f"{script} needs a CUDA GPU (or --tiny for the CPU smoke test)")
        device, dtype = torch.device("cuda"), torch.bfloat16
    names = args.cases or list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {list(cases)}")
    return device, dtype, cases, names


def parse_tiles(text: str) -> tuple[int, int]:
    """ "16x128" -> (BLOCK_M, BLOCK_N) = (16, 128)."""
    block_m, block_n = (int(v) for v in text.lower().split("x"))
    return block_m, block_n


def sweep_case(
    name: str,
    shape: tuple,
    splits: list[int],
    iters: int,
    device,
    dtype,
    tiles: list[tuple[int, int]] = (),
    reduce_blocks: list[int] = (),
) -> dict:
    from longspec.kernels.split_kv_attn.triton import default_config, split_kv_attn

    layers, B, H, Hkv, D, Tq, context = shape
    slots = context + 128
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        return torch.randn(*size, generator=generator, device=device, dtype=dtype)

    caches = [(rand(B, Hkv, slots, D), rand(B, Hkv, slots, D)) for _ in range(layers)]
    q = rand(B, H, Tq, D)
    lengths = torch.full((B,), context, device=device, dtype=torch.int32)  # on the device, as the engine's
    causal = Tq > 1  # a chain: the queries are the last Tq cached keys

    def run(config):
        return [split_kv_attn(q, k, v, lengths, causal=causal, config=config)[0] for k, v in caches]

    default = default_config((H // Hkv) * Tq, B * Hkv, slots, D, device)
    reference = run(None)[0].float()
    row = {
        "case": name,
        "layers": layers,
        "batch": B,
        "queries": Tq,
        "context": context,
        "rows": (H // Hkv) * Tq,
        "floor_ms": layers * 2 * B * Hkv * context * D * dtype.itemsize / HBM_BYTES_PER_S * 1e3,
        "default_splits": default["num_splits"],
        "default_ms": _graph_timer(lambda: run(None), iters),
        "default_tiles": f"{default['BLOCK_M']}x{default['BLOCK_N']}",
        "ms_by_splits": {},
        "max_abs_diff": 0.0,
    }
    # Keys "S" (the default's tiles), "S@MxN" or "S/rR" (the reduce merging R splits per load); at least 2 key
    # tiles per split, as the default keeps.
    variants = [("", {})] + [(f"@{m}x{n}", {"BLOCK_M": m, "BLOCK_N": n}) for m, n in tiles]
    variants += [(f"/r{r}", {"REDUCE_BLOCK_S": r}) for r in reduce_blocks]
    for label, tile in variants:
        block_n = tile.get("BLOCK_N", default["BLOCK_N"])
        for num_splits in splits:
            if num_splits > max(1, slots // (2 * block_n)):
                continue
            config = {"num_splits": num_splits, **tile}
            diff = float((run(config)[0].float() - reference).abs().max())
            row["max_abs_diff"] = max(row["max_abs_diff"], diff)
            row["ms_by_splits"][f"{num_splits}{label}"] = _graph_timer(
                lambda config=config: run(config), iters
            )
    best = min(row["ms_by_splits"], key=row["ms_by_splits"].get)
    row["best_splits"], row["best_ms"] = best, row["ms_by_splits"][best]
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=None, help=f"some of: {' '.join(CASES)}")
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96])
    parser.add_argument(
        "--tiles",
        nargs="*",
        default=[],
        type=parse_tiles,
        help="also sweep the splits in these tiles, BLOCK_MxBLOCK_N (query rows x keys), e.g. 16x64 16x128",
    )
    parser.add_argument(
        "--reduce-blocks",
        nargs="*",
        default=[],
        type=int,
        help="also sweep the splits with the reduce merging this many splits per load (default tiles)",
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="tiny cases on the CPU, Triton's interpreter")
    parser.add_argument("--json", default="split_kv_sweep.json", help="output path when $OUT is not set")
    args = parser.parse_args(argv)
    device, dtype, cases, names = sweep_setup(parser, args, "split_kv_sweep", CASES, TINY)
    rows = []
    for name in names:
        row = sweep_case(
            name, cases[name], args.splits, args.iters, device, dtype, args.tiles, args.reduce_blocks
        )
        by_splits = " ".join(f"{s}:{ms:.3f}" for s, ms in row["ms_by_splits"].items())
        print(
            f"{name}: floor {row['floor_ms']:.3f} ms, default ({row['default_splits']} splits, "
            f"{row['default_tiles']}) "
            f"{row['default_ms']:.3f} ms, best ({row['best_splits']}) {row['best_ms']:.3f} ms | {by_splits}",
            flush=True,
        )
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = os.path.join(os.environ["OUT"], "split_kv_sweep.json") if os.environ.get("OUT") else args.json
    write_json_atomic(out, {**run_info(), "args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
