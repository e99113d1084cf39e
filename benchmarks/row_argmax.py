"""The index of each row's largest value over a vocabulary, by route: a round's greedy picks (the drafter's chain
levels, the verify's target choice at T = 0) and a sampled chain's one draw per level (the exponential race's
winner, argmax of q / E) are each one such reduction over a [rows, V] tensor.

    PYTHONPATH=. python benchmarks/row_argmax.py [--vocab 49152 128256] [--rows 1 2 8 16 69]

Routes: `torch.argmax(x, -1)`, `torch.topk(x, 1).indices` (a radix select), a two-stage max in torch (max over
blocks of 1024 columns, then over the blocks), and `kernel`: `longspec.kernels.row_argmax.row_argmax` (what a round
runs: on CUDA two Triton launches, per (row, 2048-column chunk), then per row). Each is captured 50 times in one CUDA graph and replayed, so the
time per call is device time without launch overhead (a round replays its steps from graphs too). Every route is
first checked to return argmax's indices on inputs without ties. Writes $OUT/row_argmax.json when OUT is set.
"""

from __future__ import annotations

import argparse
import os

import torch

from longspec.atomic import write_json_atomic
from longspec.kernels.row_argmax import row_argmax
from longspec.provenance import run_info


def two_stage_argmax(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """argmax over the last dim as max over column blocks (many rows of work for a few rows of input), then over
    the blocks' maxima."""
    vocab = x.shape[-1]
    pad = -vocab % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    values, index = x.unflatten(-1, (-1, block)).max(-1)  # [..., blocks]
    best = values.argmax(-1, keepdim=True)
    return best[..., 0] * block + index.gather(-1, best)[..., 0]


ROUTES = {
    "argmax": lambda x: x.argmax(-1),
    "topk1": lambda x: x.topk(1, dim=-1).indices[..., 0],
    "two_stage": two_stage_argmax,
    "kernel": row_argmax,
}


def time_route(fn, x: torch.Tensor, calls: int = 50, replays: int = 20) -> float:
    """Microseconds per call, replaying a graph of `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16, 69])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("row_argmax.py times CUDA graphs: it needs a GPU")
    rows_out = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for vocab in args.vocab:
            for rows in args.rows:
                # a permutation per row: no ties, so every route must agree exactly
                x = (
                    torch.rand(rows, vocab, device="cuda").argsort(-1).to(dtype)
                    if dtype == torch.float32
                    else None
                )
                if x is None:  # bf16 cannot hold distinct values over a vocabulary: one clear maximum per row
                    x = torch.randn(rows, vocab, device="cuda").clamp(max=3.0).to(dtype)
                    x[torch.arange(rows), torch.randint(0, vocab, (rows,))] = 8.0
                want = x.argmax(-1)
                row = {"dtype": dtype_name, "vocab": vocab, "rows": rows}
                for name, fn in ROUTES.items():
                    if not torch.equal(fn(x), want):
                        raise AssertionError(f"{name} disagrees with argmax at {row}")
                    row[f"{name}_us"] = round(time_route(fn, x), 2)
                rows_out.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if os.environ.get("OUT"):
        write_json_atomic(
            os.path.join(os.environ["OUT"], "row_argmax.json"), {**run_info(argv=argv), "rows": rows_out}
        )
    return rows_out


if __name__ == "__main__":
    main()
