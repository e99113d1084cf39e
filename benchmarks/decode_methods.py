"""Decode speed of the target-only methods the eval harness compares, on a random target of a preset's shape.

    PYTHONPATH=. python benchmarks/decode_methods.py [--preset gpu100m] [--contexts 4096 8192 16384] [--tokens 64]
    PYTHONPATH=. python benchmarks/decode_methods.py --shape smollm2 --contexts 4096 8192  # SmolLM2-135M shape
    PYTHONPATH=. python benchmarks/decode_methods.py --preset smoke --contexts 64 --tokens 8     # CPU smoke
    PYTHONPATH=. python benchmarks/decode_methods.py --target DIR --drafter DIR --data SUITE/qmsum_8k.jsonl \
        --contexts 4096 --methods ar_graphs pld_graphs longspec_graphs --temperature 1  # a real pair, real text

For each context length and method (vanilla_hf = HF eager, vanilla_fa = HF SDPA / flash-attn, hf_compile = HF
StaticCache + torch.compile, ar = our engine, ar_graphs = our engine replaying CUDA graphs, pld = prompt lookup)
it generates --tokens tokens from a random prompt (or --data's) --repeats times and prints tokens/s of each
repeat: the first repeat at a new context length shows what shape-dependent set-up (kernel selection, autotuning,
graph capture) costs, the later ones the steady state the harness should report. The repeats go round-robin
over the methods, so that a shared machine's drift between them hits every method alike. Eager methods also print each
phase's ms per round (draft, verify with acceptance, commit; the median over the repeats).
With --no-cudnn-sdp the SDPA baseline runs with PyTorch's cuDNN attention backend disabled.
longspec / longspec_graphs (opt in with --methods) decode with a random drafter (or --drafter) and --tree (auto:
the adaptive policy, its round costs measured first for the contexts given; or fixed widths like 4,16,16): each
row then also records which trees ran.
--profile adds one run per method under torch.profiler (device kernels, wall vs device-busy time), --host-profile
one under cProfile (the host's Python time per token, by function).
--target DIR (a converted checkpoint or, with --gguf-file, a GGUF) decodes with the real target's weights, and
--drafter DIR with a trained drafter exported for it (several, `--drafter K8K=DIR_A K32K=DIR_B`: each longspec
method runs once per drafter, as rows `longspec@K8K`, ..., on the same target and prompts: e.g. draft
vocabulary sizes compared round for round); --data SOURCE takes each context's prompt from an evaluation
data source (the end of its first prompt at least that long, as batch_throughput.py does) instead of random tokens:
the round-by-round costs of a real pair on real text, where a random prompt and drafter only show plain rounds.
Writes JSON to $OUT/decode_methods.json when OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import os
import statistics
import sys
import time

import torch

from longspec.atomic import write_json_atomic
from longspec.infer.baselines import run_method
from longspec.infer.engine import GenerationConfig, SpeculativeEngine
from longspec.pipeline.code_target.presets import MODEL_PRESETS
from longspec.provenance import run_info
from longspec.target import TargetModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from batch_throughput import data_prompts, load_data_prompts  # noqa: E402
from shapes import SHAPES, random_target  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpu100m", choices=sorted(MODEL_PRESETS))
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default=None, help="a real model's shape instead of --preset"
    )
    parser.add_argument("--vocab-size", type=int, default=8192, help="with --preset")
    parser.add_argument(
        "--target", default=None, help="a real target's directory instead of --shape / --preset"
    )
    parser.add_argument("--gguf-file", default=None, help="with --target: the GGUF file in it")
    parser.add_argument(
        "--drafter",
        nargs="+",
        default=None,
        metavar="[LABEL=]DIR",
        help="a trained drafter's export directory (longspec methods); several: each longspec method runs once "
        "per drafter (rows `longspec@LABEL`), all on the same target and prompts, interleaved",
    )
    parser.add_argument(
        "--data", default=None, help="prompts from this evaluation data source (needs --target)"
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--methods", nargs="+", default=["vanilla_hf", "vanilla_fa", "hf_compile", "ar", "ar_graphs"]
    )
    parser.add_argument("--no-cudnn-sdp", action="store_true")
    parser.add_argument(
        "--tree",
        default="auto",
        help="longspec's tree: auto, fixed widths like 4,16,16, or a round shape by name (lookup16x4: a lookup "
        "forest every round)",
    )
    parser.add_argument("--window", type=int, default=512, help="the random drafter's window (longspec)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature of every method (0: greedy)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed repeats, one more run of each method under torch.profiler: wall vs device-busy time "
        "(how much of a token the device waits for the host), the top host ops, a trace per method in $OUT",
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="after the timed repeats, one more run of each method under cProfile: the Python functions with the "
        "most own host time per generated token (what the host does between launches, and where it waits)",
    )
    args = parser.parse_args(argv)

    from transformers import LlamaConfig

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.no_cudnn_sdp and cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)
    longest = max(args.contexts) + args.tokens
    if args.data and not args.target:
        parser.error("--data needs --target (its tokenizer)")
    if args.target:
        kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
        target = TargetModel.from_pretrained(args.target, dtype=dtype, device=device, **kwargs)
        config = target.config
    else:
        if args.shape:
            config = SHAPES[args.shape](attn_implementation="sdpa")
            config.max_position_embeddings = max(config.max_position_embeddings, longest)
        else:
            shape = dict(MODEL_PRESETS[args.preset])
            shape["max_position_embeddings"] = max(shape["max_position_embeddings"], longest)
            config = LlamaConfig(vocab_size=args.vocab_size, attn_implementation="sdpa", **shape)
        target = random_target(config, device, dtype)
    tree = tuple(int(w) for w in args.tree.split(",")) if "," in args.tree else args.tree
    drafters = {None: None}  # label -> drafter (None: no longspec method)
    if any(m.startswith("longspec") for m in args.methods):
        from longspec.drafter import Drafter, DrafterConfig

        if args.drafter:
            from longspec.target_source import load_tokenizer

            tokenizer = load_tokenizer(args.target, args.gguf_file) if args.target else None
            labelled = drafter_labels(args.drafter)
            drafters = {
                label: Drafter.from_pretrained(path, target, tokenizer, dtype=dtype, device=device)
                for label, path in labelled.items()
            }
            if len(drafters) == 1:
                drafters = {None: next(iter(drafters.values()))}
        else:
            drafter_config = DrafterConfig.from_target_config(target.config, window=args.window)
            drafter = Drafter(drafter_config, target.embed_tokens, target.lm_head)
            drafters = {None: drafter.to(device=device, dtype=dtype).requires_grad_(False)}
    # One engine per drafter, all on the one target (each its own cache); target-only methods run on the first.
    engines = {label: SpeculativeEngine(target, drafter) for label, drafter in drafters.items()}
    for engine in engines.values():
        engine.reserve_for([max(args.contexts)], GenerationConfig(max_new_tokens=args.tokens))
    generator = torch.Generator().manual_seed(0)
    documents = load_data_prompts(args.data, args.target, args.gguf_file) if args.data else None
    # What runs: (row name, method, drafter label: None for a target-only method), longspec once per drafter.
    runs = []
    for method in args.methods:
        if method.endswith("_graphs") and not cuda:
            continue
        labels = list(engines) if method.startswith("longspec") else [None]
        runs += [(method if label is None else f"{method}@{label}", method, label) for label in labels]

    rows = []
    for context in args.contexts:
        if documents is not None:
            prompt = data_prompts(documents, context, 1)[0]
        else:
            prompt = torch.randint(0, config.vocab_size, (context,), generator=generator).tolist()
        # Set-up first (each run's config; tree=auto's round costs, untimed like the eval's warm-up), then the
        # repeats round-robin over the runs: a shared machine's drift hits every method alike, and each
        # method's first repeat still shows its own set-up cost (compilation, capture).
        setups = []
        for name, method, label in runs:
            config_ = GenerationConfig(
                max_new_tokens=args.tokens,
                cuda_graphs=method.endswith("_graphs"),
                tree=tree,
                temperature=args.temperature,
            )
            engine = engines[label] if label in engines else next(iter(engines.values()))
            table = None
            if method.startswith("longspec") and config_.fixed_tree is None:
                table = engine.measure_round_costs(
                    config_, [min(args.contexts), max(args.contexts) + args.tokens]
                )
            run = functools.partial(
                run_method, method.removesuffix("_graphs"), prompt, config_, target=target, engine=engine
            )
            setups.append((name, method, label, run, table))
        timed = {name: [] for name, *_ in setups}
        for _ in range(args.repeats):
            for name, _, _, run, _ in setups:
                timed[name].append(run().stats)
        for name, method, label, run, table in setups:
            rows.append(
                measured_row(
                    context, name, label, timed[name], graphs=method.endswith("_graphs"), table=table
                )
            )
            if args.profile:
                out = os.environ.get("OUT")
                trace = os.path.join(out, f"trace_{name}_{context}.json") if out else None
                rows[-1]["profile"] = profile = profile_once(run, device, trace)
                summary = {k: round(v, 4) for k, v in profile.items() if not k.startswith("top_")}
                print(f"  profile: {summary}", flush=True)
                for k in profile["top_device_kernels"]:
                    print(
                        f"    {k['ms_per_token']:.3f} ms/token  {k['calls_per_token']:.1f} x {k['us_per_call']:.1f} us"
                        f"  {k['kernel'][:90]}",
                        flush=True,
                    )
            if args.host_profile:
                rows[-1]["host_profile"] = functions = host_profile_once(run)
                for f in functions:
                    print(
                        f"    host {f['own_us_per_token']:8.1f} us/token own, {f['cumulative_us_per_token']:8.1f} "
                        f"cumulative, {f['calls_per_token']:5.2f} calls/token  {f['function']}",
                        flush=True,
                    )
            phase_note = ""
            if "phase_ms_per_round" in rows[-1]:
                phase_note = "  ms per round (median): " + ", ".join(
                    f"{phase} {ms:.2f}" for phase, ms in rows[-1]["phase_ms_per_round"].items()
                )
            print(
                f"context {context:>6} {name:<11} tok/s per repeat: "
                + " ".join(f"{s:8.1f}" for s in rows[-1]["tokens_per_s"])
                + phase_note,
                flush=True,
            )
    if os.environ.get("OUT"):
        write_json_atomic(
            os.path.join(os.environ["OUT"], "decode_methods.json"),
            {**run_info(device=device, argv=argv), "args": vars(args), "rows": rows},
        )
    return rows


def drafter_labels(specs: list[str]) -> dict[str, str]:
    """--drafter's `[LABEL=]DIR` arguments -> {label: directory}; a bare DIR is labelled by its folder's name."""
    labelled = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep:
            label, path = os.path.basename(os.path.normpath(spec)), spec
        if not label or label in labelled:
            raise SystemExit(f"--drafter {spec!r}: give each drafter its own label (LABEL=DIR)")
        labelled[label] = path
    return labelled


def measured_row(context: int, name: str, label, stats: list, *, graphs: bool, table=None) -> dict:
    """One run's row from its repeats' `GenerationStats`: tokens/s per repeat, the rounds of each repeat (tree,
    accepted drafts, wall ms), which trees ran, the median ms per round of each phase (eager rounds time draft /
    verify with acceptance / commit apart; a graph round is timed whole) and, for tree=auto, the round costs the
    policy started from."""
    row = {"context": context, "method": name, "tokens_per_s": [s.tokens_per_s for s in stats]}
    if label is not None:
        row["drafter"] = label
    row["rounds"] = [
        [list(r) for r in zip(s.round_trees or [None] * s.rounds, s.accepted, s.round_ms, strict=False)]
        for s in stats
    ]
    if not graphs:
        per_round = [1e3 / max(s.rounds, 1) for s in stats]
        phases = [
            [s.draft_s * k, s.verify_s * k, s.overhead_s * k] for s, k in zip(stats, per_round, strict=True)
        ]
        row["phase_ms_per_round"] = dict(
            zip(
                ("draft", "verify", "commit"),
                (statistics.median(p) for p in zip(*phases, strict=True)),
                strict=True,
            )
        )
    trees: dict[str, int] = {}
    for s in stats:
        for tree_name, count in s.trees.items():
            trees[tree_name] = trees.get(tree_name, 0) + count
    if trees:
        row["trees"] = trees
    if table is not None:
        row["round_costs_s"] = table.to_dict()
    return row


def profile_once(run, device: torch.device, trace: str | None = None) -> dict:
    """One `run()` (a generation) under torch.profiler: wall time, the device's busy time (the sum of its
    kernels, graph replays included) and their ratio per generated token, the 12 host ops with the most self
    time, and the 24 device kernels with the most time (per token: calls and milliseconds; µs per call). A
    device busy for much less than the wall time waits between kernels: for the host, or for launches inside
    a graph. `trace`: write the Chrome trace there (gzipped)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        result = run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    busy_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events)
    tokens = max(result.stats.num_new_tokens, 1)
    if trace:
        prof.export_chrome_trace(trace)
        with open(trace, "rb") as raw, gzip.open(trace + ".gz", "wb") as packed:
            packed.write(raw.read())
        os.remove(trace)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "wall_ms_per_token": 1e3 * wall / tokens,
        "device_busy_ms_per_token": busy_us / 1e3 / tokens,
        "device_busy_share": busy_us / 1e6 / wall if wall > 0 else float("nan"),
        "top_host_ops": [
            {"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in top
        ],
        "top_device_kernels": device_kernels(events, tokens),
    }


def host_profile_once(run, top: int = 25) -> list[dict]:
    """One `run()` (a generation) under cProfile: the `top` Python functions by own host time, per generated
    token, with their cumulative time and calls. A host-bound loop shows its cost here; the round's one wait
    for the device shows as the own time of the host copy's event synchronisation."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    result = run()
    profiler.disable()
    tokens = max(result.stats.num_new_tokens, 1)
    stats = pstats.Stats(
        profiler
    ).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, _)
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [
        {
            "function": f"{os.path.basename(file)}:{line} {name}",
            "calls_per_token": calls / tokens,
            "own_us_per_token": 1e6 * own / tokens,
            "cumulative_us_per_token": 1e6 * cumulative / tokens,
        }
        for (file, line, name), (_, calls, own, cumulative, _) in rows
    ]


def device_kernels(events, tokens: int, top: int = 24) -> list[dict]:
    """The `top` device kernels of profiler averages `events` by their time, per generated token (graph
    replays' kernels included); host ops are left out."""
    kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA") and e.count]
    kernels = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    return [
        {
            "kernel": e.key[:160],
            "calls_per_token": e.count / tokens,
            "us_per_call": e.self_device_time_total / e.count,
            "ms_per_token": e.self_device_time_total / 1e3 / tokens,
        }
        for e in kernels
    ]


if __name__ == "__main__":
    main()
