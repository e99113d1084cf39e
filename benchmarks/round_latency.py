"""Latency of one decode step and one speculative round against the bytes floor, at a real model's shape.

    PYTHONPATH=. python benchmarks/round_latency.py [--contexts 8192 32768] [--iters 20]   # CUDA, bf16, 8B shape
    PYTHONPATH=. python benchmarks/round_latency.py --shape smollm2 --contexts 4096 8192   # SmolLM2-135M shape
    PYTHONPATH=. python benchmarks/round_latency.py --target DIR [--gguf-file F] --contexts 4096 8192  # real weights
    PYTHONPATH=. python benchmarks/round_latency.py --shape qwen25_coder_05b --contexts 32768 --draft-vocab 32768
    PYTHONPATH=. python benchmarks/round_latency.py --tiny                                 # CPU smoke test

Builds a model of the --shape (8b: Llama-3.1-8B; smollm2: SmolLM2-135M-Instruct; qwen25_coder_05b:
Qwen2.5-Coder-0.5B-Instruct) with random weights (meta-device
build, then random init on the GPU: nothing is downloaded), or loads --target, fills the target KV cache with random K/V of `context` tokens (prefill is not what is measured),
and times, per context (CUDA events, median of --iters after --warmup):
- AR step, HF: one token through the HF model (sdpa) on a DynamicCache holding the context;
- AR step, ours: one token through our engine (static cache, our attention backends), eager;
- AR step, ours + CUDA graph: the same step replayed from a captured graph (packed q/k/v and gate/up
  projections, fused add + RMSNorm, q/k norm + RoPE and SiLU * up kernels: `TargetModel.pack_weights`), and
  "unfused": the same graph step through the HF modules' own projections and element-wise ops (verify too);
  and with --layer-routes (default liger torch) the packed graph step with Liger's kernels or the plain PyTorch
  references for the element-wise steps, each first compared with ours (max abs logit difference recorded);
- AR step, HF static cache + torch.compile(mode="reduce-overhead"): transformers' own fastest decoding (the
  cache is prefilled with `context` random tokens by the model itself; compilation happens in the warm-up);
- speculative round: draft (dynamic beam tree, default widths -> 69 nodes, random drafter, window 512) and
  verify (one target forward over the tree), each eager and graph-captured, then accept (greedy, with the host
  sync it needs) -- the round = draft (graph) + verify (graph) + accept;
- launches: the kernels (and copies) one static AR step and one static draft pass put on the GPU, counted by
  the profiler (a graph replays the same work as that many nodes); on the CPU, the top-level ATen ops;
- bytes floor: weights (all but the embedding table, of which a step reads one row per token) + the context's
  K/V, read once at 4.3 TB/s (the H200's HBM bandwidth).
Goals (issue 4): round <= 1.5x the same engine's AR step; graph AR step within 1.5x of the floor.
Prints a markdown table last; writes JSON to $OUT/round_latency.json when OUT is set, else to --json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

from longspec.atomic import write_json_atomic
from longspec.drafter import Drafter, DrafterConfig
from longspec.drafter.vocab import DraftVocab
from longspec.infer.accept import greedy_accept
from longspec.infer.baselines import _cache_kwarg, _CompiledDecoder, using_attn_implementation
from longspec.infer.candidates import DEFAULT_TREE_WIDTHS
from longspec.infer.engine import GenerationConfig, SpeculativeEngine
from longspec.infer.tree import TreeLayout, chain_tree
from longspec.provenance import run_info
from longspec.target import TargetModel
from longspec.testing import make_tiny_hf_model  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # shapes.py beside it
from shapes import SHAPES, random_target  # noqa: E402

HBM_BYTES_PER_S = 4.3e12


def _verify(engine, tree, **kwargs) -> torch.Tensor:
    """One sequence's tree [N] through the round runner's verify -> logits [N, V]."""
    return engine.runner.verify(tree.per_sequence(lambda t: t[None]), **kwargs)[0]


def _draft(engine, root: torch.Tensor, layout, **kwargs):
    """The drafter's tree [N] for one root (0-d) through the round runner."""
    return engine.runner.draft(root.reshape(1), layout, **kwargs).row(0)


def build_target(args, device: torch.device, dtype: torch.dtype) -> TargetModel:
    """A random Llama of --shape built on the meta device and initialised in place on `device`, the real model at
    --target, or (--tiny) the test config on CPU."""
    if args.tiny:
        return TargetModel(make_tiny_hf_model("llama").to(device=device, dtype=dtype)).to(device)
    if args.target:
        kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
        return TargetModel.from_pretrained(args.target, dtype=dtype, device=device, **kwargs)
    return random_target(SHAPES[args.shape](attn_implementation="sdpa"), device, dtype)


def fill_random_cache(engine: SpeculativeEngine, context: int, generator: torch.Generator) -> None:
    """The engine's target cache holds `context` committed tokens of random (not zero) K/V."""
    cache = engine.cache
    for tensor in (cache.keys, cache.values):
        tensor[:, :, :, :context].normal_(0.0, 1.0, generator=generator)
    cache.length = context


def hf_cache(target: TargetModel, engine: SpeculativeEngine, context: int):
    """An HF DynamicCache holding the same random K/V (the HF baseline's own cache)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    for layer in range(target.num_layers):
        cache.update(
            engine.cache.keys[layer, :, :, :context].clone(),
            engine.cache.values[layer, :, :, :context].clone(),
            layer,
        )
    return cache


def time_hf_step(timer, hf_model, token: torch.Tensor, cache) -> float:
    """One HF decode step (the cache grows by one token per run, as in HF decoding)."""
    kwargs = {_cache_kwarg(hf_model): cache, "use_cache": True}
    return timer(lambda: hf_model(token.reshape(1, 1), **kwargs).logits)


def time_hf_compiled_step(timer, target: TargetModel, context: int, generator: torch.Generator) -> float:
    """One decode step of transformers' StaticCache + torch.compile(mode="reduce-overhead") path
    (longspec.infer.baselines.hf_compiled_generate's step), after the model itself prefilled `context` random
    tokens; each timed step appends one token, as in decoding."""
    hf_model, device = target.model, target.embed_tokens.weight.device
    kwarg = _cache_kwarg(hf_model)
    decoder = _CompiledDecoder(hf_model)
    iters = timer.warmup + timer.iters
    with using_attn_implementation(hf_model, "sdpa"):
        cache = decoder.cache_for(hf_model, context + iters + 1)
        prompt = torch.randint(0, target.vocab_size, (1, context), device=device, generator=generator)
        hf_model(prompt, use_cache=True, logits_to_keep=1, **{kwarg: cache})
        token = prompt[:, -1:]
        position = torch.full((1, 1), context, dtype=torch.long, device=device)

        def step():
            nonlocal position
            decoder.step(token, position_ids=position, use_cache=True, **{kwarg: cache})
            position = position + 1

        return timer(step)


LAYER_ROUTES = ("ours", "liger", "torch", "unfused")


def _liger_ops():
    """The layer's element-wise steps through Liger's Triton kernels (fused add + RMSNorm, RoPE, fused gate-up
    SwiGLU), adapted to `longspec.modules.layer_ops`' signatures; the cache write stays a scatter."""
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    from longspec.kernels.layer_ops import write_kv

    def add_rms_norm(x, residual, weight, eps):
        if residual is None:
            return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False), x
        return LigerFusedAddRMSNormFunction.apply(x, residual, weight, eps, 0.0, "llama", False)

    def qkv_rope(qkv, cos, sin, num_heads, num_kv_heads, *, q_norm=None, k_norm=None, eps=1e-6, cache=None):
        if q_norm is not None:
            raise ValueError("the liger route has no q/k norm (Qwen3)")
        B, T, width = qkv.shape
        D = width // (num_heads + 2 * num_kv_heads)
        q, k, v = qkv.view(B, T, -1, D).split([num_heads, num_kv_heads, num_kv_heads], dim=2)
        q, k = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if cache is not None:
            write_kv(*cache, k, v)
        return q, k, v

    return add_rms_norm, qkv_rope, lambda gate_up: LigerFusedGateUpSiLUMulFunction.apply(gate_up)


@contextlib.contextmanager
def layer_route(engine: SpeculativeEngine, route: str):
    """The target's layers through `route`, to time the routes side by side: "ours" (packed projections,
    longspec's Triton kernels for the element-wise steps), "liger" (Liger's kernels for them), "torch" (the
    plain-PyTorch references), "unfused" (the HF modules: 5 projections, eager element-wise ops). The steps
    built meanwhile are dropped on both sides, so no route replays another's graphs."""
    from longspec.kernels import layer_ops as kernels
    from longspec.modules import layer_ops

    target = engine.target
    names = ("add_rms_norm", "qkv_rope", "silu_mul")
    saved, packed = tuple(getattr(layer_ops, n) for n in names), target.packed
    replacement = {
        "liger": _liger_ops,
        "torch": lambda: (kernels.add_rms_norm_naive, kernels.qkv_rope_naive, kernels.silu_mul_naive),
    }.get(route, lambda: saved)()
    for name, fn in zip(names, replacement, strict=True):
        setattr(layer_ops, name, fn)
    if route == "unfused":
        target.packed = None
    engine.target_step.steps = {}
    try:
        yield
    finally:
        for name, fn in zip(names, saved, strict=True):
            setattr(layer_ops, name, fn)
        target.packed = packed
        engine.target_step.steps = {}


class Timer:
    """Median milliseconds of fn() over `iters` runs after `warmup` runs (CUDA events on GPU)."""

    def __init__(self, device: torch.device, warmup: int, iters: int):
        self.device, self.warmup, self.iters = device, warmup, iters

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def device_launches(fn, device: torch.device) -> list[tuple[str, float]]:
    """The work items one call of fn() puts on the device, in order, as (name, µs): kernels, copies and memsets on
    a GPU (what a CUDA graph replays as nodes, one launch each when eager), timed by the profiler; on the CPU, the
    top-level ATen ops it dispatches (their CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()  # any lazily built state (a static step's buffers) is built outside the count
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.events()
    if device.type == "cuda":
        ours = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        ours = [e for e in events if e.cpu_parent is None and e.name.startswith("aten::")]
    ours.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in ours]


def count_launches(fn, device: torch.device) -> int:
    """How many work items one call of fn() puts on the device (`device_launches`)."""
    return len(device_launches(fn, device))


def kernel_summary(launches: list[tuple[str, float]], width: int = 70) -> str:
    """`device_launches` as lines "µs  name", in launch order, with the total."""
    lines = [f"{us:8.1f}  {name[:width]}" for name, us in launches]
    return "\n".join(lines + [f"{sum(us for _, us in launches):8.1f}  total of {len(launches)} launches"])


def _try_graph(row: dict, key: str, measure) -> None:
    """A capture that fails is recorded (and the eager figure used) rather than losing the whole run."""
    try:
        row[key] = measure()
    except Exception as exc:  # noqa: BLE001 - reported in the table's JSON
        row[key.replace("_ms", "_error")] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"{key}: capture failed: {row[key.replace('_ms', '_error')]}", flush=True)


def bench_context(
    target,
    drafter,
    engine,
    context: int,
    timer: Timer,
    capture: bool,
    routes: tuple[str, ...] = (),
    hf_compile: bool = True,
    widths: tuple[int, ...] = DEFAULT_TREE_WIDTHS,
) -> dict:
    device = engine.device
    generator = torch.Generator(device=device).manual_seed(context)
    layout = TreeLayout(widths)
    engine.reserve(context + layout.num_nodes + 8)
    fill_random_cache(engine, context, generator)
    root = torch.tensor(1234 % target.vocab_size, device=device)
    one = chain_tree(root, root.new_empty(0), 0, 1)
    row: dict = {"context": context}

    with torch.no_grad():
        # Correctness first: our eager step == our static step (the graph's path) on this very cache.
        eager = _verify(engine, one)
        static = _verify(engine, one, static=True, capture=False).clone()
        row["ar_static_vs_eager_max_abs_diff"] = float((eager.float() - static.float()).abs().max())

        row["ar_hf_ms"] = time_hf_step(timer, target.model, root, hf_cache(target, engine, context))
        if capture and hf_compile:
            _try_graph(
                row, "ar_hf_compile_ms", lambda: time_hf_compiled_step(timer, target, context, generator)
            )
        row["ar_ours_ms"] = timer(lambda: _verify(engine, one))
        row["ar_ours_static_ms"] = timer(lambda: _verify(engine, one, static=True, capture=False))
        row["ar_launches"] = count_launches(lambda: _verify(engine, one, static=True, capture=False), device)
        if capture:
            row["ar_ours_graph_ms"] = timer(lambda: _verify(engine, one, static=True, capture=True))
            with layer_route(engine, "unfused"):  # the same graph step through the HF modules, unfused
                row["ar_ours_graph_unfused_ms"] = timer(
                    lambda: _verify(engine, one, static=True, capture=True)
                )
            for route in routes:  # other kernels for the fused steps, each checked against ours first
                try:
                    with layer_route(engine, route):
                        replayed = _verify(engine, one, static=True, capture=True).float()
                        row[f"ar_graph_{route}_max_abs_diff"] = float((replayed - static.float()).abs().max())
                        row[f"ar_graph_{route}_ms"] = timer(
                            lambda: _verify(engine, one, static=True, capture=True)
                        )
                except Exception as exc:  # noqa: BLE001 - a route that cannot run here is recorded, not fatal
                    row[f"ar_graph_{route}_error"] = f"{type(exc).__name__}: {exc}"[:300]

        prompt = torch.randint(0, target.vocab_size, (context,), device=device, generator=generator)
        engine.history.prefill([prompt])
        engine.draft_step.prefill([prompt])
        tree = _draft(engine, root, layout)
        static_tree = _draft(engine, root, layout, static=True, capture=False)
        row["draft_static_matches_eager"] = all(
            torch.equal(a, b) for a, b in zip(tree.dynamic_part(), static_tree.dynamic_part(), strict=True)
        )
        row["tree_nodes"] = tree.num_nodes
        launches = device_launches(lambda: _draft(engine, root, layout, static=True, capture=False), device)
        row["draft_launches"] = len(launches)
        row["draft_kernels"] = [[name, us] for name, us in launches]
        row["draft_ms"] = timer(lambda: _draft(engine, root, layout))
        if capture:
            _try_graph(
                row,
                "draft_graph_ms",
                lambda: timer(lambda: _draft(engine, root, layout, static=True, capture=True)),
            )
        row["verify_ms"] = timer(lambda: _verify(engine, tree))
        if capture:
            _try_graph(
                row,
                "verify_graph_ms",
                lambda: timer(lambda: _verify(engine, tree, static=True, capture=True)),
            )
            with layer_route(engine, "unfused"):
                row["verify_graph_unfused_ms"] = timer(
                    lambda: _verify(engine, tree, static=True, capture=True)
                )
        logits = _verify(engine, tree)
        row["accept_ms"] = timer(
            lambda: greedy_accept(
                tree.tokens, tree.parents, tree.depths, tree.ancestor_mask, logits.argmax(-1), tree.valid
            )[0].tolist()  # the host needs the path: include that sync
        )
        if capture and "verify_graph_ms" in row:  # the replayed graphs compute what the eager code computes
            replayed = _verify(engine, tree, static=True, capture=True).float()
            row["verify_graph_vs_eager_max_abs_diff"] = float((replayed - logits.float()).abs().max())
        if capture and "draft_graph_ms" in row:
            replayed_tree = _draft(engine, root, layout, static=True, capture=True)
            row["draft_graph_matches_eager"] = all(
                torch.equal(a, b)
                for a, b in zip(tree.dynamic_part(), replayed_tree.dynamic_part(), strict=True)
            )
        draft = row.get("draft_graph_ms", row["draft_ms"])
        verify = row.get("verify_graph_ms", row["verify_ms"])
        row["round_ms"] = draft + verify + row["accept_ms"]

    weight_bytes = sum(
        p.numel() * p.element_size() for n, p in target.model.named_parameters() if "embed_tokens" not in n
    )
    committed_keys = engine.cache.keys[:, :, :, :context]  # [L, B, Hkv, context, D]
    kv_bytes = 2 * committed_keys.numel() * committed_keys.element_size()  # K and V
    row["floor_ms"] = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3
    ar_same_engine = row.get("ar_ours_graph_ms", row["ar_ours_ms"])
    row["round_over_ar"] = row["round_ms"] / ar_same_engine
    row["graph_ar_over_floor"] = row["ar_ours_graph_ms"] / row["floor_ms"] if capture else None
    return row


def table(rows: list[dict]) -> str:
    cols = [
        ("context", "context", "d"),
        ("ar_hf_ms", "AR HF ms", ".2f"),
        ("ar_ours_ms", "AR ours ms", ".2f"),
        ("ar_hf_compile_ms", "AR HF static+compile ms", ".2f"),
        ("ar_ours_graph_unfused_ms", "AR ours+graph, unfused ms", ".2f"),
        ("ar_ours_graph_ms", "AR ours+graph ms", ".2f"),
        ("ar_graph_liger_ms", "AR graph, Liger kernels ms", ".2f"),
        ("ar_graph_torch_ms", "AR graph, torch element-wise ms", ".2f"),
        ("ar_launches", "AR launches", "d"),
        ("draft_launches", "draft launches", "d"),
        ("draft_ms", "draft ms", ".2f"),
        ("draft_graph_ms", "draft+graph ms", ".2f"),
        ("verify_ms", "verify ms", ".2f"),
        ("verify_graph_unfused_ms", "verify+graph, unfused ms", ".2f"),
        ("verify_graph_ms", "verify+graph ms", ".2f"),
        ("round_ms", "round ms", ".2f"),
        ("floor_ms", "floor ms", ".2f"),
        ("round_over_ar", "round/AR", ".2f"),
        ("graph_ar_over_floor", "graph AR/floor", ".2f"),
    ]
    return markdown_table(rows, cols)


def markdown_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """Rows as a markdown table; cols = (key, header, format spec); a missing value prints "–"."""
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append(
            "| " + " | ".join("–" if r.get(k) is None else format(r[k], f) for k, _, f in cols) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="context lengths (default 8192 32768)"
    )
    parser.add_argument("--iters", type=int, default=None, help="timed runs per measurement (median)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument(
        "--tiny", action="store_true", help="tiny random Llama on CPU: a smoke test of this script"
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="random-weight model shape")
    parser.add_argument("--target", default=None, help="a real target (HF dir) instead of random weights")
    parser.add_argument("--gguf-file", default=None, help="with --target: a GGUF file inside it (or a path)")
    parser.add_argument("--json", default="round_latency.json", help="output path when $OUT is not set")
    parser.add_argument(
        "--tree",
        type=int,
        nargs="+",
        default=list(DEFAULT_TREE_WIDTHS),
        help="the draft tree's level widths the draft / verify / round rows time (1: one draft step, a chain of one)",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="the drafter drafts over a draft vocabulary of this many ids (its head: that many rows); 0: the "
        "target's whole vocabulary",
    )
    parser.add_argument(
        "--round-costs",
        action="store_true",
        help="also time the engine's whole round (draft + verify + accept + commit, as generate runs it) for "
        "every tree=auto candidate at T=0 and T=1 (SpeculativeEngine.measure_round_costs), and the drafter ring's "
        "catch-up step",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="print the draft step's launches in order, each with its profiled time (always in the JSON)",
    )
    parser.add_argument(
        "--no-hf-compile",
        action="store_true",
        help="skip the HF static cache + torch.compile step (its compilation takes minutes on a GPU)",
    )
    parser.add_argument(
        "--layer-routes",
        nargs="*",
        default=["liger", "torch"],
        choices=[r for r in LAYER_ROUTES if r not in ("ours", "unfused")],
        help="also time the graph AR step with these kernels for the fused element-wise steps (GPU)",
    )
    args = parser.parse_args(argv)

    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32
        contexts, iters, warmup = args.contexts or [64, 128], args.iters or 2, args.warmup or 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("round_latency needs a CUDA GPU (or --tiny for the CPU smoke test)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        contexts, iters, warmup = args.contexts or [8192, 32768], args.iters or 20, args.warmup or 3
    capture = device.type == "cuda"

    target = build_target(args, device, dtype)
    window = 16 if args.tiny else 512
    drafter_config = DrafterConfig.from_target_config(target.config, window=window)
    drafter = (
        Drafter(drafter_config, target.embed_tokens, target.lm_head)
        .to(device=device, dtype=dtype)
        .requires_grad_(False)
        .eval()
    )
    vocab_size = target.config.vocab_size
    if 0 < args.draft_vocab < vocab_size:  # which ids does not change the cost: the first K
        drafter.use_draft_vocab(DraftVocab(torch.arange(args.draft_vocab), vocab_size))
    engine = SpeculativeEngine(target, drafter)
    timer = Timer(device, warmup, iters)
    routes = tuple(args.layer_routes) if capture else ()
    rows = [
        bench_context(
            target, drafter, engine, context, timer, capture, routes, not args.no_hf_compile, tuple(args.tree)
        )
        for context in contexts
    ]

    round_costs, catch_up_ms = {}, None
    if args.round_costs:
        for temperature in (0.0, 1.0):
            config = GenerationConfig(temperature=temperature, cuda_graphs=capture, static_shapes=True)
            costs = engine.measure_round_costs(config, contexts, reps=iters)
            round_costs[f"T={temperature:g}"] = {k: v * 1e3 for k, v in costs.to_dict().items()}
        # The drafter ring's catch-up, which the first drafting round after plain or lookup rounds runs first
        # (fixed shapes: the window's K/V whatever is missing, so one figure; its graph was built above).
        catch_up_ms = timer(lambda: engine.runner.catch_up(static=True, capture=capture))

    result = {
        **run_info(device=device, argv=argv),
        "dtype": str(dtype).removeprefix("torch."),
        "model": "tiny" if args.tiny else (args.target or f"random {args.shape}"),
        "draft_vocab_size": drafter.draft_vocab_size,
        "iters": iters,
        "rows": rows,
        "round_costs_ms": round_costs,
        "catch_up_ms": catch_up_ms,
    }
    out_dir = os.environ.get("OUT")
    path = os.path.join(out_dir, "round_latency.json") if out_dir else args.json
    write_json_atomic(path, result)
    for r in rows:
        checks = {k: r[k] for k in r if k.endswith(("_diff", "_matches_eager"))}
        print(f"checks at {r['context']}: " + ", ".join(f"{k}={v}" for k, v in checks.items()))
    print(table(rows))
    if args.kernels:
        for r in rows:
            print(f"the draft step's launches at {r['context']} (eager, profiler µs):")
            print(kernel_summary(r["draft_kernels"]))
    for mode, costs in round_costs.items():
        print(f"whole round, ms ({mode}): " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()))
    if catch_up_ms is not None:
        print(
            f"the ring's catch-up (before a drafting round that follows plain or lookup rounds): {catch_up_ms:.3f} ms"
        )
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
