"""Pretrain the project's own small Llama code target on the stdlib corpus, or evaluate one (issue 5).

    # corpus + tokenizer first (see data_prep.stdlib_corpus / data_prep.train_tokenizer), then:
    python -m longspec.pipeline.code_target --corpus DIR --tokenizer TOKDIR --tokens-dir DIR/tokens --out CKPT \
        --preset tiny --max-minutes 3
    python -m longspec.pipeline.code_target --tokenize-only --corpus DIR --tokenizer TOKDIR --tokens-dir DIR/tokens
    python -m longspec.pipeline.code_target --eval-only CKPT --corpus DIR          # held-out loss/acc + greedy samples

The train split is tokenized once into a flat uint16 stream (``<s> file </s> <s> file </s> ...``), cut into packed
``seq_len`` windows (a fresh random phase each epoch), and fed to an HF ``LlamaForCausalLM`` with AdamW, linear warmup
and cosine decay. The schedule's progress is ``max(step / max_steps, elapsed / max_minutes)``, so a wall-clock budget
still ends with a decayed learning rate (that run is then no longer bit-reproducible; a step budget is). The
checkpoint with the best held-out loss is saved (bf16 safetensors + tokenizer), atomically.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch

from longspec.cli import ArgumentParser, run_cli
from longspec.ownership import check_output_dir
from longspec.pipeline.code_target.data import load_token_cache, load_tokenizer
from longspec.pipeline.code_target.evaluate import eval_checkpoint, greedy_samples
from longspec.pipeline.code_target.presets import MODEL_PRESETS, PretrainConfig
from longspec.pipeline.code_target.trainer import CODE_TARGET_KIND, log, save_checkpoint, train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m longspec.pipeline.code_target",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--corpus", type=Path, help="dir with train.jsonl/heldout.jsonl (data_prep.stdlib_corpus)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer dir (data_prep.train_tokenizer)")
    p.add_argument("--tokens-dir", type=Path, help="uint16 token cache (default: CORPUS/tokens)")
    p.add_argument("--out", type=Path, help="checkpoint output dir")
    p.add_argument("--preset", default="tiny", choices=sorted(MODEL_PRESETS))
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-epochs", type=float, default=20.0)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--max-minutes", type=float)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, help="torch CPU threads (e.g. 1 on a shared machine)")
    p.add_argument("--max-checkpoint-mb", type=float, default=25.0)
    p.add_argument("--tokenize-only", action="store_true", help="build the token cache and exit")
    p.add_argument("--eval-only", type=Path, metavar="CKPT", help="evaluate a saved checkpoint and exit")
    p.add_argument("--eval-seq-len", type=int, default=1024, help="--eval-only window length")
    p.add_argument("--eval-max-tokens", type=int, help="--eval-only: held-out tokens to score (default all)")
    p.add_argument("--num-samples", type=int, default=3, help="--eval-only: greedy continuations to print")
    p.add_argument("--summary-json", type=Path, help="also write the run's summary / eval result here")
    return p.parse_args(argv)


def _main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens_dir = args.tokens_dir or (args.corpus / "tokens" if args.corpus else None)

    if args.eval_only is not None:
        result = eval_checkpoint(
            args.eval_only, tokens_dir=tokens_dir, corpus=args.corpus, seq_len=args.eval_seq_len,
            batch_size=args.batch_size or 4, device=args.device, num_samples=args.num_samples,
            max_tokens=args.eval_max_tokens,
        )  # fmt: skip
        for i, s in enumerate(result["samples"]):
            print(f"--- sample {i}: distinct {s['distinct_ratio']:.2f}, longest run {s['longest_run']}, "
                  f"token match {s['token_match']:.2f}\n[prefix ...]{s['prefix_tail']}[greedy ->]{s['continuation']}")  # fmt: skip
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
        if args.summary_json:
            args.summary_json.write_text(json.dumps(result, indent=2) + "\n")
        return

    if args.tokenizer is None or tokens_dir is None:
        raise ValueError("--tokenizer and --tokens-dir (or --corpus) are required to train")
    if args.out is not None:  # a user's folder is refused now, not after the training
        check_output_dir(args.out, CODE_TARGET_KIND, what="--out", whole=True)
    tokenizer = load_tokenizer(args.tokenizer)
    train_ids, heldout_ids = load_token_cache(tokens_dir, tokenizer, args.corpus)
    if args.tokenize_only:
        print(
            json.dumps(
                {
                    "tokens_dir": str(tokens_dir),
                    "train": int(train_ids.size),
                    "heldout": int(heldout_ids.size),
                }
            )
        )
        return
    cfg = PretrainConfig(
        tokenizer=args.tokenizer, tokens_dir=tokens_dir, corpus=args.corpus, out=args.out, preset=args.preset,
        seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, max_epochs=args.max_epochs, max_steps=args.max_steps,
        max_minutes=args.max_minutes, eval_every=args.eval_every, log_every=args.log_every, seed=args.seed,
        device=args.device, max_checkpoint_mb=args.max_checkpoint_mb,
    )  # fmt: skip
    model, summary = train(cfg, train_ids, heldout_ids, tokenizer)
    heldout_t = torch.from_numpy(heldout_ids.astype(np.int64))
    summary["samples"] = greedy_samples(model, tokenizer, heldout_t)
    for s in summary["samples"]:
        log.info("greedy sample: distinct %.2f longest run %d token match %.2f: %r",
                 s["distinct_ratio"], s["longest_run"], s["token_match"], s["continuation"][:200])  # fmt: skip
    if cfg.out is not None:
        weights = save_checkpoint(model, tokenizer, cfg.out, summary)
        size_mb = weights.stat().st_size / 1e6
        log.info("saved %s (%.2f MB)", cfg.out, size_mb)
        if size_mb > cfg.max_checkpoint_mb:
            raise ValueError(
                f"{weights} is {size_mb:.1f} MB, over --max-checkpoint-mb {cfg.max_checkpoint_mb}"
            )
    if args.summary_json:
        args.summary_json.write_text(json.dumps(summary, indent=2) + "\n")
    print(
        json.dumps({k: summary[k] for k in ("steps", "best_step", "tokens_seen", "train_seconds", "heldout")})
    )


def main(argv: list[str] | None = None) -> int:
    """A missing tokenizer / token cache or a bad flag value is one line on stderr (exit 2); `--debug` re-raises."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
