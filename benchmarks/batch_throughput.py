"""Batched decoding throughput (issue 13): batched graph AR vs batched LongSpec (a fixed tree, or tree=auto), per batch
size and context, on a real model's shape.

    PYTHONPATH=. python benchmarks/batch_throughput.py --accept-profile 0.8,0.7,0.6,0.5,0.4        # CUDA, bf16, 8B
    PYTHONPATH=. python benchmarks/batch_throughput.py --accept-profile EVAL_DIR/results.json     # a measured profile
    PYTHONPATH=. python benchmarks/batch_throughput.py --accept-profile 0.5,0.5 --tree 4,16,16,16,16  # a fixed tree
    PYTHONPATH=. python benchmarks/batch_throughput.py --shape smollm2 --contexts 4096 8192       # SmolLM2-135M shape
    PYTHONPATH=. python benchmarks/batch_throughput.py --target DIR [--gguf-file F] [--dtype float32]  # real weights
    PYTHONPATH=. python benchmarks/batch_throughput.py --target DIR --data SUITE/qmsum_8k.jsonl --contexts 4096  # real text
    PYTHONPATH=. python benchmarks/batch_throughput.py --tiny --accept-profile 1,0.5              # CPU smoke test

For each context (default 8192 32768) and batch size (default 1 2 4 8 16): B prompts of about `context` tokens
(ragged: row b has context - 3 b): random tokens, or with --data the ends of an evaluation data source's real
prompts (a real --target then writes what it writes on real text: on random tokens its greedy output tends to
repeat itself, which lookup chains exploit), then, each after an untimed short warm-up (graph capture):
- ar: `generate_batch(method="ar")`, CUDA graphs on GPU: batched graph AR, the baseline;
- longspec: `generate_batch(method="longspec")` with --tree auto (the default, as the engine's: the adaptive policy
  at that batch size; the rounds per tree are recorded) or a fixed tree (--tree 4,16,16,16,16);
- vanilla_fa (off with --no-vanilla-fa): HF decoding with SDPA / flash-attn of the same B prompts together
  (left-padded, `baselines.hf_generate_batch`), after an untimed short run on the prompts' last 1024 tokens;
  each row's output is checked against ar's first tokens (a difference is counted, not raised: in bf16 a padded
  attention may break a near-tie). --vanilla-fa-tokens N decodes N tokens per row instead of --tokens: at 32K x
  16 on the 8B shape HF's growing cache makes a step ~0.5 s, and a step's cost moves by < 1% over 256 tokens of a
  32K cache, so a shorter run measures the same rate in a fraction of the time (the JSON records N).
tokens/s = all tokens the batch decoded (each row's first token, from the prefill, excluded) / the batch's decode
wall time (prefill excluded); speedup = longspec / ar. The script checks, and records per sequence, that longspec's
output == ar's (the lossless invariant). On a GPU in bf16 a near-tie may differ: each differing row is run once
more through the target (`eval.divergence`) and recorded as a near-tie or a real divergence, not raised; a real
divergence also records whether the row decoded alone (graph AR, batch 1) equals the batched ar or longspec
output, which says which batched path left the target's greedy text.

Acceptance: a random drafter accepts nothing (τ ~ 1). --accept-profile p1,p2,... makes the draft follow a given
per-depth acceptance profile instead (a trained-τ stand-in, `ProfileDrafter`): p_d = P(the depth-d draft token is
accepted | depth d-1 was), e.g. a trained drafter's measured profile on the real target. How: the target's greedy
continuation of every prompt is known from the ar run of the same cell (which must therefore run first); the
stand-in runs the real (random) drafter -- so the draft costs what a drafter of this shape costs -- then, per row
and tree level, with probability p_d puts the continuation's next token on top of every node's children, and
otherwise bans it (the top children are then wrong tokens). Limits: the tree's other candidates are the random
drafter's, so only the top path ever gets accepted (a trained drafter's second candidates sometimes are); the draws
are independent across rounds and rows (a real drafter's are correlated with the text); depths past the profile
accept nothing; and once a row's output diverges from ar's (a bf16 near-tie) its stand-in proposes the wrong text,
so that row then accepts nothing. Random weights would diverge within a few tokens (flat logits):
`give_greedy_margin` gives them a robust greedy choice at the same cost; a real --target keeps its weights.
The expected τ of a profile, 1 + sum_d prod_{i<=d} p_i (at the tree's depth), is recorded beside the measured one.
Prints a markdown table last; writes JSON to $OUT/batch_throughput.json when OUT is set, else to --json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from round_latency import SHAPES, build_target, markdown_table  # noqa: E402

from longspec.atomic import write_json_atomic  # noqa: E402
from longspec.drafter import Drafter, DrafterConfig  # noqa: E402
from longspec.eval.divergence import analyse_divergence, explained  # noqa: E402
from longspec.eval.summary import pooled_acceptance_profile  # noqa: E402
from longspec.infer.baselines import run_method_batch  # noqa: E402
from longspec.infer.candidates import DEFAULT_TREE_WIDTHS  # noqa: E402
from longspec.infer.engine import GenerationConfig, SpeculativeEngine  # noqa: E402
from longspec.infer.policy import named_by_bucket  # noqa: E402
from longspec.infer.policy.measure import cost_mode  # noqa: E402
from longspec.infer.slots import bucket  # noqa: E402
from longspec.provenance import run_info  # noqa: E402

MAX_PROFILE_DEPTH = 64  # profile entries past the given ones are 0


class ProfileDrafter:
    """A drafter whose top draft follows a per-depth acceptance profile (module docstring): the real drafter's
    computation, with the logits of every tree level rewritten on the device (no host sync, graph-capturable).
    Shape legend: B rows, P nodes of a level, V vocabulary, L reference tokens per row."""

    def __init__(self, drafter, profile: list[float], max_len: int):
        self.inner = drafter
        self.max_len = max_len
        device = next(drafter.parameters()).device
        self.profile = torch.zeros(MAX_PROFILE_DEPTH + 1, device=device)  # index = a child's depth
        self.profile[1 : len(profile) + 1] = torch.tensor(profile, dtype=torch.float32)
        self.buffers: dict[int, torch.Tensor] = {}  # per batch size: captured graphs keep the address
        self.references: torch.Tensor | None = None  # [B, L]: prompt ++ greedy continuation, per row
        self._depths = self._targets = None

    def __getattr__(self, name):  # everything else is the wrapped drafter's
        return getattr(self.inner, name)

    def set_references(self, sequences: list[list[int]]) -> None:
        """Each row's prompt followed by the target's greedy continuation (token at index p = position p)."""
        rows = torch.full((bucket(len(sequences)), self.max_len), -1)  # -1: unknown; static batches run
        for row, tokens in enumerate(sequences):  # padded to their bucket (infer.slots)
            tokens = tokens[: self.max_len]
            rows[row, : len(tokens)] = torch.tensor(tokens)
        self._use(rows.to(self.profile.device))

    def select_rows(self, index: list[int]) -> None:
        """The references follow the engine's slots when a static batch shrinks (`SpeculativeEngine`): slot i
        now decodes what slot index[i] did."""
        rows = self.references.index_select(0, torch.tensor(index, device=self.references.device))
        self._use(rows)

    def _buffer(self, batch: int) -> torch.Tensor:
        """The references of batch size `batch` (-1 = unknown until set): one buffer per size, since the steps
        captured at that size (a warm-up, a shrink) read its address."""
        if batch not in self.buffers:
            self.buffers[batch] = torch.full(
                (batch, self.max_len), -1, dtype=torch.long, device=self.profile.device
            )
        return self.buffers[batch]

    def _use(self, rows: torch.Tensor) -> None:
        """Copy `rows` [b, <= L] into the buffer of batch b."""
        buffer = self._buffer(rows.shape[0])
        buffer.fill_(-1)
        buffer[:, : rows.shape[1]] = rows
        self.references = buffer

    def tree_level(self, input_ids, nodes, level, *args):
        positions = nodes.positions[:, level]  # [B, P]; slot 0 is the root
        self._depths = (positions - nodes.positions[:, :1] + 1).clamp(max=MAX_PROFILE_DEPTH)  # the children's
        references = self._buffer(positions.shape[0])  # this batch size's, whichever was set last
        self._targets = references.gather(1, (positions + 1).clamp(max=self.max_len - 1))  # [B, P]
        return self.inner.tree_level(input_ids, nodes, level, *args)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.inner.logits(hidden).float()  # [B, P, V]
        draw = torch.rand(logits.shape[0], 1, device=logits.device)  # one per row and level
        # Past a row's reference (the last round overshoots the ar run's tokens) the continuation is unknown:
        # the drafter's own top token is banned there instead, so the stand-in does not accept by chance.
        known = self._targets >= 0  # [B, P]
        targets = torch.where(known, self._targets, logits.argmax(dim=-1))
        accept = (draw < self.profile[self._depths]) & known  # [B, P]
        top = logits.amax(dim=-1) + 10.0  # far above the rest: the reference token is the top child
        value = torch.where(accept, top, torch.full_like(top, float("-inf")))  # else banned: a wrong top
        # Not kept: under capture these tensors live in the graph's private memory pool, and one live block
        # keeps that pool from being freed when the engine that captured it goes.
        self._depths = self._targets = None
        return logits.scatter(-1, targets[..., None], value[..., None])


def give_greedy_margin(target, generator: torch.Generator, scale: float = 0.01) -> str:
    """Random weights give flat logits: bf16 and fp32 greedy of a random Llama already disagree at some positions
    (tests/benchmarks/test_batch_throughput.py: 8 of 256 on its config), so a batched verify and an AR step, whose
    kernels round differently, leave each other's text within a few tokens, and the stand-in, which proposes the
    AR text, then accepts nothing. This makes the random target's greedy choice robust, at the same cost (same
    shapes, same kernels): every layer's output projections (attention out, MLP down) are scaled by `scale`, so
    a position's residual stream is its token's embedding plus small context terms, and (untied LM heads) the
    LM head's rows are the embedding rows permuted, so the greedy successor of
    token x is perm(x), by a top-two logit gap far above bf16's rounding step (the same test: bf16 and fp32
    greedy then agree everywhere). A tied head can only repeat x.
    Returns what was done, for the JSON."""
    model = target.model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
        embed, head = target.embed_tokens.weight, target.lm_head.weight
        if head.data_ptr() == embed.data_ptr():
            return f"random; layer outputs x {scale}; tied head: the greedy successor of x is x"
        order = torch.randperm(embed.shape[0], generator=generator).to(embed.device)
        head.copy_(embed[order])
    return (
        f"random; layer outputs x {scale}; LM head = permuted embedding rows: greedy successor of x = perm(x)"
    )


def measured_profile(results_path: str, method: str = "longspec") -> list[float]:
    """A drafter's measured acceptance profile, from a `python -m longspec.eval` results.json: P(depth d accepted |
    depth d-1 was), pooled over the rounds of every sample whose target reference is not degenerate
    (`eval.quality`: a looping reference would inflate it), cut at the first depth no round reached."""
    with open(results_path) as f:
        results = json.load(f)
    kept = []
    for dataset, records in results["methods"].get(method, {}).items():
        quality = results["summary"][dataset][method]["quality"]  # JSON: keyed by str(sample id)
        kept += [r for r in records if not quality.get(str(r["id"]), {"degenerate": True})["degenerate"]]
    profile = pooled_acceptance_profile(kept)
    if None in profile:
        profile = profile[: profile.index(None)]
    if not profile:
        raise SystemExit(
            f"{results_path}: no {method} rounds on non-degenerate samples to measure a profile from"
        )
    return profile


def parse_tree(text: str) -> tuple[int, ...] | str:
    """--tree: "auto" (the adaptive policy, with round costs measured at each cell's batch size) or widths."""
    return "auto" if text == "auto" else tuple(int(w) for w in text.split(","))


def expected_tau(profile: list[float], depth: int) -> float:
    """1 + sum_d prod_{i<=d} p_i over the tree's depths: τ when every round runs the whole tree."""
    tau, reach = 1.0, 1.0
    for p in (profile + [0.0] * depth)[:depth]:
        reach *= p
        tau += reach
    return tau


def prompts_for(context: int, batch: int, vocab: int, generator: torch.Generator) -> list[list[int]]:
    return [
        torch.randint(0, vocab, (context - 3 * row,), generator=generator).tolist() for row in range(batch)
    ]


def data_prompts(documents: list[list[int]], context: int, batch: int) -> list[list[int]]:
    """--data: row b is the last context - 3 b tokens of the b-th prompt at least `context` tokens long (cycling
    through them). The prompt's end is kept: a LongBench-style prompt puts its question after the document."""
    long_enough = [ids for ids in documents if len(ids) >= context]
    if not long_enough:
        longest = max((len(ids) for ids in documents), default=0)
        raise SystemExit(
            f"--data: no prompt of {context} tokens or more (the longest has {longest}): lower --contexts"
        )
    rows = [long_enough[row % len(long_enough)] for row in range(batch)]
    return [ids[len(ids) - (context - 3 * row) :] for row, ids in enumerate(rows)]


def load_data_prompts(source: str, tokenizer_path: str, gguf_file: str | None) -> list[list[int]]:
    """Every prompt of an evaluation data source (`python -m longspec.eval`'s data.name: a JSONL path or a
    LongBench task), built and tokenized as the evaluation builds them, whatever its length."""
    from longspec.eval.datasets import load_samples
    from longspec.target_source import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path, gguf_file)
    samples, _ = load_samples(source, tokenizer, context_len=2**62, min_prompt_tokens=0, context_margin=0)
    return [sample.prompt_ids for sample in samples]


def timed_batch(engine, prompts, config, method: str, repeats: int, before=lambda: None):
    """Untimed warm-up (`SpeculativeEngine.warm_up`, 8 tokens: graph capture and kernel selection at the batch's
    bucket and the smaller ones a shrink reaches), then `repeats` timed runs: (results of the last run, median
    tokens/s of the batch). `before()` runs before each run (outside its timing)."""
    before()
    engine.warm_up(max(prompts, key=len), config, batch_size=len(prompts), method=method)
    speeds = []
    for _ in range(repeats):
        before()
        results = engine.generate_batch(prompts, config, method=method)
        tokens = sum(max(r.stats.num_new_tokens - 1, 0) for r in results)
        decode_s = results[0].stats.decode_s  # every row's: the batch's decode wall time
        speeds.append(tokens / decode_s if decode_s > 0 else float("nan"))
    return results, statistics.median(speeds)


def bench_cell(engine, drafter, prompts, args, widths, capture: bool) -> tuple[dict, list[list[int]]]:
    """The cell's row, and ar's output per sequence (vanilla_fa's check)."""
    tree = {"tree": "auto"} if widths == "auto" else {"tree_widths": widths}
    config = GenerationConfig(max_new_tokens=args.tokens, cuda_graphs=capture, static_shapes=True, **tree)
    row: dict = {"context": len(prompts[0]), "batch": len(prompts)}
    # The cache both methods' whole runs need, before any warm-up: a warm-up of 8 tokens reserved less, so the
    # first timed run reallocated it and re-captured its steps inside the timing (the ar baseline, every cell).
    engine.reserve_for([len(p) for p in prompts], config)
    start = time.perf_counter()
    ar, row["ar_tok_s"] = timed_batch(engine, prompts, config, "ar", args.repeats)
    # Each phase's line as it ends: a run stopped by a time limit still shows how far its cell got.
    print(f"  {row['context']} x {row['batch']}: ar {row['ar_tok_s']:.1f} tok/s "
          f"({time.perf_counter() - start:.0f} s with warm-up)", flush=True)  # fmt: skip
    before = lambda: None  # noqa: E731
    if isinstance(drafter, ProfileDrafter):  # the stand-in proposes ar's greedy continuation, from the first
        references = [p + r.tokens for p, r in zip(prompts, ar, strict=True)]  # slots (a run may shrink them)
        before = lambda: drafter.set_references(references)  # noqa: E731
    torch.manual_seed(args.seed)  # the stand-in's draws
    start = time.perf_counter()
    spec, row["longspec_tok_s"] = timed_batch(engine, prompts, config, "longspec", args.repeats, before)
    print(f"  {row['context']} x {row['batch']}: longspec {row['longspec_tok_s']:.1f} tok/s "
          f"({time.perf_counter() - start:.0f} s with warm-up and round-cost measurement)", flush=True)  # fmt: skip
    row["speedup"] = row["longspec_tok_s"] / row["ar_tok_s"]
    row["lossless"] = [s.tokens == a.tokens for s, a in zip(spec, ar, strict=True)]
    row["longspec_matches_ar"] = all(row["lossless"])
    # Where a row differs: a bf16 near-tie of the target (not a failure), or a real divergence (a bug)?
    row["divergences"] = []
    for index, (p, s, a) in enumerate(zip(prompts, spec, ar, strict=True)):
        if s.tokens == a.tokens:
            continue
        divergence = analyse_divergence(engine.target.model, p, s.tokens, a.tokens).to_dict()
        if not divergence["near_tie"]:  # which batched output is off: the row decoded alone (graph AR) says
            alone = engine.generate(torch.tensor(p, device=engine.device), config, method="ar").tokens
            divergence.update(
                row=index, alone_equals_ar=alone == a.tokens, alone_equals_longspec=alone == s.tokens
            )
        row["divergences"].append(divergence)
    row["near_ties_only"] = all(d["near_tie"] for d in row["divergences"])
    # explained: near-ties, or batched AR's own departures from the target's argmax (`reference_off`: the target
    # run alone on the common prefix ranks longspec's token first)
    row["explained_only"] = all(map(explained, row["divergences"]))
    rounds = sum(s.stats.rounds for s in spec)
    row["tau"] = (sum(sum(s.stats.accepted) for s in spec) + rounds) / rounds if rounds else float("nan")
    row["tokens_per_row"] = [r.stats.num_new_tokens for r in spec]
    row["trees"] = {}  # rounds per tree, summed over rows (one tree for a fixed --tree)
    for result in spec:
        for name, count in result.stats.trees.items():
            row["trees"][name] = row["trees"].get(name, 0) + count
    if widths == "auto":  # what the policy weighed: the warm-up's round costs and the times it then observed
        rows = bucket(len(prompts))
        table = engine.cost_tables[cost_mode(config, rows)]
        row["round_costs_ms"] = {k: round(v * 1e3, 4) for k, v in table.to_dict().items()}
        policy = next(p for p in engine.policies.values() if p.costs.base is table)
        row["observed_round_ms"] = {
            k: round(v * 1e3, 4) for k, v in named_by_bucket(policy.costs.mean).items()
        }
    return row, [a.tokens for a in ar]


def bench_vanilla_fa(target, prompts: list[list[int]], args, ar_tokens: list[list[int]] | None) -> dict:
    """Batched HF vanilla_fa of the cell's prompts (after an untimed short run): median tokens/s over the batch
    (each row's first token, from the prefill, excluded, as for ar and longspec), and how many rows' output
    equals ar's."""
    new_tokens = args.vanilla_fa_tokens or args.tokens
    config = GenerationConfig(max_new_tokens=new_tokens)
    # The warm-up only selects kernels: a full-length prefill here would cost as much as the timed one's.
    short = [p[-1024:] for p in prompts]
    run_method_batch("vanilla_fa", short, GenerationConfig(max_new_tokens=min(8, new_tokens)), target=target)
    speeds = []
    for _ in range(args.repeats):
        results = run_method_batch("vanilla_fa", prompts, config, target=target)
        tokens = sum(max(r.stats.num_new_tokens - 1, 0) for r in results)
        decode_s = results[0].stats.decode_s
        speeds.append(tokens / decode_s if decode_s > 0 else float("nan"))
    row = {"vanilla_fa_tok_s": statistics.median(speeds), "vanilla_fa_tokens": new_tokens}
    print(f"  {len(prompts[0])} x {len(prompts)}: vanilla_fa {row['vanilla_fa_tok_s']:.1f} tok/s", flush=True)
    if ar_tokens is not None:
        row["vanilla_fa_rows_equal_ar"] = sum(
            r.tokens == t[: len(r.tokens)] for r, t in zip(results, ar_tokens, strict=True)
        )
    return row


def table(rows: list[dict]) -> str:
    cols = [
        ("context", "context", "d"),
        ("batch", "batch", "d"),
        ("ar_tok_s", "AR tok/s", ".1f"),
        ("longspec_tok_s", "LongSpec tok/s", ".1f"),
        ("speedup", "LongSpec/AR", ".2f"),
        ("tau", "τ", ".2f"),
        ("vanilla_fa_tok_s", "vanilla FA tok/s", ".1f"),
        ("speedup_vs_vanilla_fa", "LongSpec/vanilla FA", ".2f"),
        ("longspec_matches_ar", "== AR", ""),
        ("near_ties_only", "differences all near-ties", ""),
        ("explained_only", "differences all near-ties or AR's", ""),
    ]
    return markdown_table(rows, cols)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 1 2 4 8 16")
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="default 8192 32768")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per sequence (default 256)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per cell (median)")
    parser.add_argument(
        "--tree",
        default=None,
        help="longspec's tree: auto (the default, as GenerationConfig's: round costs measured at each cell's batch "
        "size, the tree chosen per round) or fixed widths, e.g. 4,16,16,16,16 (--tiny: 2,2,2)",
    )
    parser.add_argument(
        "--accept-profile",
        default=None,
        help="p1,p2,...: per-depth acceptance of the stand-in drafter, or an eval results.json to measure it "
        "from (its longspec records on non-degenerate samples); default: the random drafter",
    )
    parser.add_argument("--no-vanilla-fa", action="store_true", help="skip the HF vanilla_fa baseline")
    parser.add_argument(
        "--vanilla-fa-tokens",
        type=int,
        default=None,
        help="new tokens per row for vanilla_fa (default --tokens)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tiny", action="store_true", help="tiny random Llama on CPU: a smoke test of this script"
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="random-weight model shape")
    parser.add_argument("--target", default=None, help="a real target (HF dir) instead of random weights")
    parser.add_argument("--gguf-file", default=None, help="with --target: a GGUF file inside it (or a path)")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="on a GPU; float32 keeps a real --target's outputs free of bf16 near-ties, after which the stand-in "
        "drafter proposes text the row no longer writes and accepts nothing (τ then falls below the profile's)",
    )
    parser.add_argument(
        "--data",
        default=None,
        help="prompts from an evaluation data source (a JSONL path or a LongBench task, as the eval's data.name), "
        "tokenized by the target's tokenizer: row b keeps the last context - 3 b tokens of a prompt at least "
        "`context` long; default: random tokens",
    )
    parser.add_argument("--tokenizer", default=None, help="with --data: the tokenizer (default: --target's)")
    parser.add_argument("--json", default="batch_throughput.json", help="output path when $OUT is not set")
    args = parser.parse_args(argv)
    documents = None
    if args.data is not None:
        if not (args.tokenizer or args.target):
            raise SystemExit("--data needs the target's tokenizer: --target DIR or --tokenizer DIR")
        documents = load_data_prompts(args.data, args.tokenizer or args.target, args.gguf_file)

    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32
        batch_sizes, contexts = args.batch_sizes or [1, 2], args.contexts or [40]
        args.tokens, window, widths = args.tokens or 8, 8, parse_tree(args.tree or "2,2,2")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("batch_throughput needs a CUDA GPU (or --tiny for the CPU smoke test)")
        device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
        batch_sizes, contexts = args.batch_sizes or [1, 2, 4, 8, 16], args.contexts or [8192, 32768]
        args.tokens, window = args.tokens or 256, 512
        widths = parse_tree(args.tree or "auto")
    capture = device.type == "cuda"
    profile = None
    if args.accept_profile and os.path.isfile(args.accept_profile):
        profile = measured_profile(args.accept_profile)
    elif args.accept_profile:
        profile = [float(p) for p in args.accept_profile.split(",")]
    if profile is not None and not all(0 <= p <= 1 for p in profile):
        raise SystemExit(f"--accept-profile values must lie in [0, 1], got {profile}")

    target = build_target(args, device, dtype)
    weights = f"{args.target}, as trained"
    if not args.target:  # random weights: made robust to rounding, or bf16 near-ties derail the stand-in
        weights = give_greedy_margin(target, torch.Generator().manual_seed(args.seed))
    torch.manual_seed(args.seed)
    drafter_config = DrafterConfig.from_target_config(target.config, window=window)
    drafter = (
        Drafter(drafter_config, target.embed_tokens, target.lm_head)
        .to(device=device, dtype=dtype)
        .requires_grad_(False)
        .eval()
    )
    if profile is not None:
        nodes = sum(DEFAULT_TREE_WIDTHS if widths == "auto" else widths)  # auto's largest candidate
        drafter = ProfileDrafter(drafter, profile, max_len=max(contexts) + args.tokens + 2 * nodes + 8)
    generator = torch.Generator().manual_seed(args.seed)
    out_dir = os.environ.get("OUT")
    path = os.path.join(out_dir, "batch_throughput.json") if out_dir else args.json
    result = {
        **run_info(device=device, argv=argv),
        "dtype": str(dtype).removeprefix("torch."),
        "model": "tiny" if args.tiny else (args.target or f"random {args.shape}"),
        "target_weights": weights,
        "tree_widths": widths if widths == "auto" else list(widths),
        "tokens": args.tokens,
        "accept_profile": profile,
        # τ of the profile if every round ran the tree (tree=auto: the default tree, its largest candidate)
        "expected_tau": None
        if profile is None
        else expected_tau(profile, len(DEFAULT_TREE_WIDTHS if widths == "auto" else widths)),
        "vanilla_fa": "batched, the same prompts" if not args.no_vanilla_fa else None,
        "prompts": f"data: {args.data}" if args.data else "random tokens",
        "rows": [],
    }
    rows = result["rows"]
    for context in contexts:
        for batch in batch_sizes:
            if documents is None:
                prompts = prompts_for(context, batch, target.vocab_size, generator)
            else:
                prompts = data_prompts(documents, context, batch)
            # A fresh engine per cell: the last cell's cache and captured graphs are gone before this one's
            # cache (up to ~70 GB at batch 16, 32K, 8B shape) is allocated.
            engine = SpeculativeEngine(target, drafter)
            # What is still allocated when a cell starts (weights + anything an earlier cell left behind): on the
            # H200, 32K x batch 16 ran out of memory with ~65 GB held beyond the weights.
            allocated = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None
            ar_tokens = None
            try:
                row, ar_tokens = bench_cell(engine, drafter, prompts, args, widths, capture)
            except torch.OutOfMemoryError as error:  # recorded; the larger cells of this context are skipped
                where = traceback.extract_tb(error.__traceback__)[-3:]  # the allocation and its callers
                row = {"context": context, "batch": batch, "error": "out of memory",
                       "message": str(error).split("\n")[0],
                       "where": [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in where]}  # fmt: skip
            finally:
                del engine
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            row["allocated_gib_at_start"] = allocated
            if not args.no_vanilla_fa and "error" not in row:  # after the engine's memory is freed
                try:
                    row.update(bench_vanilla_fa(target, prompts, args, ar_tokens))
                    row["speedup_vs_vanilla_fa"] = row["longspec_tok_s"] / row["vanilla_fa_tok_s"]
                except torch.OutOfMemoryError as error:  # recorded: HF's growing DynamicCache needs more
                    row["vanilla_fa_error"] = "out of memory: " + str(error).split("\n")[0]
                finally:
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            rows.append(row)
            result["all_lossless"] = all(r.get("longspec_matches_ar", True) for r in rows)
            write_json_atomic(path, result)  # after every cell: a later failure keeps what was measured
            if "error" in row:
                print(f"context {context} batch {batch}: {row['error']} {row.get('message', '')} at "
                      f"{row.get('where')}", flush=True)  # fmt: skip
                break
            print(
                f"context {context} batch {batch}: ar {row['ar_tok_s']:.1f} tok/s, longspec "
                f"{row['longspec_tok_s']:.1f} tok/s (τ {row['tau']:.2f}), speedup {row['speedup']:.2f}, "
                f"longspec == ar: {row['longspec_matches_ar']} (differences all near-ties: "
                f"{row['near_ties_only']}; near-ties or batched AR's own: {row['explained_only']})",
                flush=True,
            )

    print(table(rows))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
