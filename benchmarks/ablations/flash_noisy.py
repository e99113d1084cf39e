"""Ablation 2 (paper: flash noisy training +14.7% acceptance length), at our scale on CPU.

    python benchmarks/ablations/flash_noisy.py --out outputs/ablations/flash_noisy \
        [--corpus outputs/quickstart/corpus] [--steps 40]
    # on the quickstart's stage-3 data (target-written continuations), with its distillation loss:
    python benchmarks/ablations/flash_noisy.py --out outputs/ablations/flash_noisy_s3 \
        --corpus outputs/quickstart/corpus --data outputs/quickstart/data/stage3 --stage-config tiny_stage3 \
        --seq-len 640 --distill-weight 1.0

Two drafters for the shipped code target, trained identically (by default stage-1 rows of 256 tokens, anchor
offsets; same data order and seed) except for the flash-noisy lag: j ~ U{1..4} per micro-batch (query t cross-attends to the
target's KV at positions <= t - j) vs none (lag 0: query t also sees the target's KV at t, which inference never
has: the target has not verified the token yet). Each is evaluated with `python -m longspec.eval` on held-out code
completion (greedy, lossless-checked against the target's own greedy output): τ and the change in τ. ~5 min on 2
cores. Resumable (same runner as longspec.pipeline).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    add_target_args,
    corpus_file,
    corpus_step,
    prep_step,
    read_metrics,
    resolve_target,
    trailing_mean,
    write_result,
)

from longspec.cli import UserError, run_cli  # noqa: E402
from longspec.infer.candidates import DEFAULT_TREE_WIDTHS  # noqa: E402
from longspec.pipeline import (  # noqa: E402
    Step,
    eval_data_overrides,
    run_pipeline,
    stage_steps,
    target_overrides,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/ablations/flash_noisy")
    parser.add_argument("--corpus", default=None, help="an existing stdlib corpus dir (default: build one)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-samples", type=int, default=3)
    parser.add_argument(
        "--data",
        default=None,
        help="a prepared data dir to train on, e.g. the quickstart's OUT/data/stage3 (target-written code "
        "continuations; pass --stage-config tiny_stage3 --seq-len 640); default: stage-1 rows built here",
    )
    parser.add_argument("--stage-config", default="tiny_stage1")
    parser.add_argument("--distill-weight", type=float, default=0.0, help="0 = the paper's loss (CE only)")
    parser.add_argument(
        "--eval-data",
        nargs="+",
        default=None,
        help="the eval's JSONL file(s), evaluated as the preset's pipeline evaluates its data (e.g. smollm2: "
        "prepared suite files such as BUNDLE/suite/lcc_4k.jsonl); default: the corpus's heldout_lcc.jsonl",
    )
    add_target_args(parser)
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    preset, target = resolve_target(args, distill_weight=args.distill_weight)
    steps, corpus = corpus_step(out, args.corpus)
    data = args.data and os.path.abspath(args.data)
    if data is None:
        data = os.path.join(out, "data", "stage1")
        steps.append(prep_step("data", "stage1", source=corpus_file(corpus, "train"), tokenizer=target, out=data,
                               seq_len=args.seq_len, max_rows=300))  # fmt: skip
    # the preset's own stage-1 settings (e.g. smollm2's precision) with this ablation's stage YAML and sizes
    stage = preset.stage1.merged(
        {"stage": {"seq_len": args.seq_len, "global_batch_size": 8, "micro_batch_size": 4},
         "max_steps": args.steps, "optim": {"lr": 3e-3}},
        config=args.stage_config,
    )  # fmt: skip
    overrides = target_overrides(preset, target)
    sources = [os.path.abspath(p) for p in args.eval_data or [os.path.join(corpus, "heldout_lcc.jsonl")]]
    if not preset.eval_suite and len(sources) != 1:
        raise UserError(f"preset {args.preset} evaluates one held-out file: pass one --eval-data")
    variants = {"noisy": True, "lag0": False}
    for variant, flag in variants.items():
        run_dir = os.path.join(out, "runs", variant)
        steps += stage_steps(preset, variant, stage.merged({"stage": {"flash_noisy": flag}}),
                             target_overrides=overrides, data_path=data, run_dir=run_dir)  # fmt: skip
        steps.append(
            Step(
                name=f"eval_{variant}",
                cmd=[sys.executable, "-m", "longspec.eval", *overrides, f"drafter.path={run_dir}/export",
                     *eval_data_overrides(preset, sources),
                     # τ of the drafter itself needs a fixed tree: under tree=auto (the default) a weak
                     # drafter's rounds go plain and both variants read τ 1.0
                     "method=[longspec,ar]", f"tree_widths=[{','.join(map(str, DEFAULT_TREE_WIDTHS))}]",
                     f"max_new_tokens={args.max_new_tokens}",
                     f"max_samples={args.max_samples}", f"output_dir={out}/eval_{variant}"],
                outputs=[os.path.join(out, f"eval_{variant}", "results.json")],
            )
        )  # fmt: skip
    run_pipeline(steps, out)

    result = {}
    for variant in variants:
        with open(os.path.join(out, f"eval_{variant}", "results.json")) as f:
            summary = json.load(f)["summary"]
        # pooled over the eval's data sources, weighted by their kept (non-degenerate) samples
        rows = [
            per_method["longspec"] for per_method in summary.values() if per_method["longspec"]["num_samples"]
        ]
        if not rows:
            raise UserError(f"eval_{variant}: no sample kept (every target output degenerate?)")
        samples = sum(row["num_samples"] for row in rows)
        losses = [r["ce"] for r in read_metrics(os.path.join(out, "runs", variant))]  # CE on the data
        result[variant] = {
            "tau": sum(row["mean_accept_length"] * row["num_samples"] for row in rows) / samples,
            # both runs are greedy with ar beside them: every row has the check
            "identical_to_greedy": sum(row["identical_to_greedy"] * row["num_samples"] for row in rows)
            / samples,
            "num_samples": samples,
            "final_train_loss": trailing_mean(losses, 5)[-1],
        }
    change = result["noisy"]["tau"] / result["lag0"]["tau"] - 1
    result["tau_change"] = change
    lines = [
        "| training | final train CE (mean of last 5 steps) | τ on the held-out data | identical to greedy |",
        "|---|---|---|---|",
    ]
    for variant, name in (("noisy", "flash noisy, lag j ~ U{1..4}"), ("lag0", "no noise (lag 0)")):
        r = result[variant]
        lines.append(
            f"| {name} | {r['final_train_loss']:.3f} | {r['tau']:.3f} | {r['identical_to_greedy']:.0%} |"
        )
    lines += [
        "",
        f"τ change from flash noisy training: {change:+.1%} ({result['noisy']['num_samples']} samples)",
    ]
    write_result(out, "flash_noisy", result, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))  # a user error is one line, exit status 2
