"""Host work of a decode round outside its static steps: the torch ops the engine's loop runs between the steps.

Why: with CUDA graphs a round's draft, verify + accept and commit are graph replays, and every other torch op
is one more launch (or copy) that the host issues between them. Once a graph AR step costs about a millisecond
(the SmolLM2 shape on a GPU: docs/BENCHMARKS.md, "The decode step and the round on a GPU"), the host's share
decides whether a plain round costs one AR step. This counts those ops per generated token, from the profiler's
top-level ops that run outside `StaticStep.__call__`, on static shapes (with CUDA graphs on a GPU; without capture
on the CPU, where the steps run eagerly and are left out the same way). Views (no kernel) are not counted.

    python benchmarks/host_ops.py --tiny                        # CPU: a tiny random Llama
    python benchmarks/host_ops.py --shape smollm2 --context 4096  # GPU: random SmolLM2-shaped weights, bf16

Prints the ops per token of each method and writes host_ops.json ($OUT or --json).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from longspec.atomic import write_json_atomic  # noqa: E402
from longspec.drafter import Drafter, DrafterConfig  # noqa: E402
from longspec.infer import graphs  # noqa: E402
from longspec.infer.engine import GenerationConfig, SpeculativeEngine  # noqa: E402
from longspec.provenance import run_info  # noqa: E402
from longspec.testing import make_tiny_target  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # shapes.py beside it
from shapes import random_target, smollm2_135m_config  # noqa: E402

STEP = "longspec.static_step"
# Ops that only make views or allocate: no kernel, no launch.
NO_LAUNCH = (
    "view", "slice", "select", "expand", "as_strided", "unsqueeze", "transpose", "reshape", "alias", "squeeze",
    "detach", "aten::t", "unbind", "split", "narrow", "empty", "resolve_", "lift", "permute",
)  # fmt: skip


@contextlib.contextmanager
def marked_steps():
    """Every StaticStep call inside a profiler range named STEP, for the duration."""
    call = graphs.StaticStep.__call__

    def marked(self, *inputs):
        with torch.profiler.record_function(STEP):
            return call(self, *inputs)

    graphs.StaticStep.__call__ = marked
    try:
        yield
    finally:
        graphs.StaticStep.__call__ = call


def _in_step(event) -> bool:
    while event is not None:
        if event.name == STEP:
            return True
        event = event.cpu_parent
    return False


def ops_outside_steps(engine, prompt: torch.Tensor, config: GenerationConfig, method: str) -> dict:
    """One warm generation, then one under the profiler: ops per token outside the steps, by name."""
    engine.generate(prompt, config, method=method)  # captures, compiles, learns round costs
    with marked_steps(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        result = engine.generate(prompt, config, method=method)
        if prompt.is_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    counts = collections.Counter(
        event.name
        for event in prof.events()
        if event.cpu_parent is None
        and event.name.startswith("aten::")
        and not any(part in event.name for part in NO_LAUNCH)
        and not _in_step(event)
    )
    tokens = len(result.tokens)
    return {
        "method": method,
        "tokens": tokens,
        "ops_per_token": sum(counts.values()) / tokens,
        "wall_ms_per_token_profiled": 1e3 * wall / tokens,
        "top_ops_per_token": {name: n / tokens for name, n in counts.most_common(12)},
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama on the CPU")
    parser.add_argument(
        "--shape", choices=["smollm2"], default="smollm2", help="random weights of this shape"
    )
    parser.add_argument(
        "--context", type=int, default=None, help="prompt tokens (default 4096; 100 with --tiny)"
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=["ar", "longspec"])
    parser.add_argument("--tree", default="auto", help="longspec's tree: auto, or fixed widths like 4,16,16")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json", default=None, help="output path when $OUT is not set")
    args = parser.parse_args(argv)

    if args.tiny:
        device, dtype, context = torch.device("cpu"), torch.float32, args.context or 100
        target = make_tiny_target("llama", num_hidden_layers=1)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("host_ops needs a CUDA GPU (or --tiny for the CPU)")
        device, dtype, context = torch.device("cuda"), torch.bfloat16, args.context or 4096
        target = random_target(smollm2_135m_config(), device, dtype)
    drafter = Drafter(
        DrafterConfig.from_target_config(target.config, window=16 if args.tiny else 512),
        target.embed_tokens,
        target.lm_head,
    )
    drafter = drafter.to(device=device, dtype=dtype).requires_grad_(False).eval()
    engine = SpeculativeEngine(target, drafter)
    tree = "auto" if args.tree == "auto" else tuple(int(w) for w in args.tree.split(","))
    config = GenerationConfig(
        max_new_tokens=args.tokens,
        temperature=args.temperature,
        tree=tree,
        static_shapes=True,
        cuda_graphs=device.type == "cuda",
    )
    engine.reserve_for([context], config)
    prompt = torch.randint(0, target.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    rows = []
    for method in args.methods:
        row = ops_outside_steps(engine, prompt.to(device), config, method)
        rows.append(row)
        top = ", ".join(
            f"{name.removeprefix('aten::')} {n:.2f}" for name, n in row["top_ops_per_token"].items()
        )
        print(f"{method}: {row['ops_per_token']:.1f} ops per token outside the steps ({top})", flush=True)
    result = {
        **run_info(device=device, argv=argv),
        "context": context,
        "tree": args.tree,
        "temperature": args.temperature,
        "rows": rows,
    }
    out = os.path.join(os.environ["OUT"], "host_ops.json") if os.environ.get("OUT") else args.json
    if out:
        write_json_atomic(out, result)
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
