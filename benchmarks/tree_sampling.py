"""The T > 0 acceptance walk down a batch of draft trees: the plain-PyTorch reference (what `sample_path` ran
before: depth x children steps of about 30 small tensor ops each) against the Triton kernel (one program per tree), each
replayed from a CUDA graph as inside the engine's verify step.

    PYTHONPATH=. python benchmarks/tree_sampling.py                       # CUDA: default tree, vocab 49152 and 128256
    PYTHONPATH=. python benchmarks/tree_sampling.py --batch-sizes 1 8 16 --tree 4,4,4
    PYTHONPATH=. python benchmarks/tree_sampling.py --tiny                # CPU smoke test (Triton interpreter)

Inputs per (batch, vocab): trees of the --tree layout with every node valid; the target's p per node =
softmax(4 g) and the drafter's q = softmax(4 g + n) (g, n standard normal: a drafter close to the target), each
child drawn from its parent's q, both rules (rrs with q, deterministic without). Before timing, the kernel's
(path, length) must equal the reference's and its residual match to 1e-12. Prints a markdown table last; writes
JSON to $OUT/tree_sampling.json when OUT is set, else to --json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from round_latency import Timer, markdown_table  # noqa: E402

from longspec.atomic import write_json_atomic  # noqa: E402
from longspec.infer.accept import target_distribution  # noqa: E402
from longspec.infer.candidates import DEFAULT_TREE_WIDTHS  # noqa: E402
from longspec.infer.tree import TreeLayout  # noqa: E402
from longspec.kernels.tree_sampling import child_table, sample_walk_naive  # noqa: E402
from longspec.provenance import run_info  # noqa: E402


def walk_inputs(widths, batch: int, vocab: int, generator: torch.Generator, device: torch.device):
    """(tokens, children, p, q, draws, depth) of random full trees of `widths` (module docstring)."""
    layout = TreeLayout(widths)
    parents = torch.full((batch, layout.num_nodes), -1, dtype=torch.long)
    for level in range(1, layout.depth + 1):
        here, above = layout.level_slice(level), layout.level_slice(level - 1)
        size = (batch, here.stop - here.start)
        parents[:, here] = torch.randint(above.start, above.stop, size, generator=generator)
    logits = torch.randn(batch, layout.num_nodes, vocab, generator=generator) * 4
    noise = torch.randn(batch, layout.num_nodes, vocab, generator=generator)
    p, q = (target_distribution(x, temperature=1.0) for x in (logits, logits + noise))
    parent_q = q.gather(1, parents.clamp(min=0)[..., None].expand(-1, -1, vocab))
    tokens = torch.multinomial(parent_q.reshape(-1, vocab), 1, generator=generator).reshape(parents.shape)
    valid = torch.ones_like(parents, dtype=torch.bool)
    children = child_table(parents, valid, max(widths))
    draws = torch.rand(batch, layout.depth * max(widths) + 1, dtype=torch.float64, generator=generator)
    move = [t.to(device) for t in (tokens, children, p, q, draws)]
    return (*move, layout.depth)


def graph_replay(fn, device: torch.device):
    """fn() replayed from a CUDA graph, as inside the engine's verify step (verify_attention's capture), or fn
    itself off CUDA."""
    if device.type != "cuda":
        return fn
    from verify_attention import graphed  # imports the attention kernels: CUDA only

    return graphed(fn)


def bench(widths, batch: int, vocab: int, rule: str, timer: Timer, device, generator) -> dict:
    from longspec.kernels.tree_sampling import sample_walk

    tokens, children, p, q, draws, depth = walk_inputs(widths, batch, vocab, generator, device)
    draft_probs = q if rule == "rrs" else None
    args = (tokens, children, p, draws, depth, draft_probs)
    ref_path, ref_length, ref_residual = sample_walk_naive(*args)
    path, length, residual = sample_walk(*args)
    row = {"batch": batch, "vocab": vocab, "rule": rule, "mean_length": ref_length.double().mean().item()}
    row["equal"] = bool(
        torch.equal(path, ref_path)
        and torch.equal(length, ref_length)
        and torch.allclose(residual, ref_residual, rtol=1e-12, atol=1e-15)
    )
    if not row["equal"]:
        raise SystemExit(f"kernel != reference at batch {batch}, vocab {vocab}, {rule}")
    row["reference_ms"] = timer(graph_replay(lambda: sample_walk_naive(*args), device))
    row["kernel_ms"] = timer(graph_replay(lambda: sample_walk(*args), device))
    row["speedup"] = row["reference_ms"] / row["kernel_ms"]
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 1 8")
    parser.add_argument("--vocabs", type=int, nargs="+", default=None, help="default 49152 128256")
    parser.add_argument("--tree", default=None, help="level widths, e.g. 4,4,4 (default: the default tree)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--tiny", action="store_true", help="CPU, Triton interpreter, tiny sizes: a smoke test"
    )
    parser.add_argument("--json", default="tree_sampling.json", help="output path when $OUT is not set")
    args = parser.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is first imported
        device, batch_sizes, vocabs, widths = torch.device("cpu"), [1, 2], [300], (2, 3, 2)
        args.iters, args.warmup = 1, 0
    else:
        if not torch.cuda.is_available():
            raise SystemExit("tree_sampling needs a CUDA GPU (or --tiny for the CPU smoke test)")
        device = torch.device("cuda")
        batch_sizes, vocabs = args.batch_sizes or [1, 8], args.vocabs or [49152, 128256]
        widths = tuple(int(w) for w in args.tree.split(",")) if args.tree else DEFAULT_TREE_WIDTHS
    timer = Timer(device, args.warmup, args.iters)
    generator = torch.Generator().manual_seed(0)
    result = {**run_info(device=device, argv=argv), "tree_widths": list(widths), "rows": []}
    for vocab in vocabs:
        for batch in batch_sizes:
            for rule in ("rrs", "deterministic"):
                row = bench(widths, batch, vocab, rule, timer, device, generator)
                result["rows"].append(row)
                print(
                    f"vocab {vocab} batch {batch} {rule}: reference {row['reference_ms']:.3f} ms, kernel "
                    f"{row['kernel_ms']:.3f} ms ({row['speedup']:.1f}x), mean walk length {row['mean_length']:.2f}",
                    flush=True,
                )
    out_dir = os.environ.get("OUT")
    path = os.path.join(out_dir, "tree_sampling.json") if out_dir else args.json
    write_json_atomic(path, result)
    cols = [
        ("vocab", "vocab", "d"),
        ("batch", "batch", "d"),
        ("rule", "rule", ""),
        ("mean_length", "mean walk length", ".2f"),
        ("reference_ms", "reference (graph) ms", ".3f"),
        ("kernel_ms", "kernel (graph) ms", ".3f"),
        ("speedup", "speedup", ".1f"),
    ]
    print(markdown_table(result["rows"], cols))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
