"""Stage-2 data: long documents -> packed 32K/64K-token rows (docs/ALGORITHM.md §3.5, stage 2; ProLong-64k style).

    python -m data_prep.stage2 --tokenizer TARGET_DIR_OR_ID --out data/stage2 \
        --source code.jsonl --source books.parquet --source tulu.jsonl [--seq-len 65536] [--min-tokens 4096]

Each source is a local JSONL/parquet file, a directory of text files, or a HF dataset id (streamed). A row is a
document (`text`) or a conversation (`messages`: [{"role", "content"}, ...]) that is rendered with the target's
chat template, as the target sees conversations. Documents shorter than --min-tokens are rejected (short text
teaches nothing about long context; it belongs in stage 1) and so are documents above --max-tokens; the rest are
EOS-separated and packed into rows of exactly --seq-len tokens (a long document continues across rows).
"""

from __future__ import annotations

import sys
from collections import Counter

from data_prep.common import (
    Packer,
    PrepRun,
    add_common_args,
    batched,
    check_messages,
    check_source,
    check_text,
    common_kwargs,
    iter_source,
    limit,
)
from longspec.cli import ArgumentParser, UserError, run_cli
from longspec.data.manifest import Manifest


def prepare_stage2(
    *,
    sources: list[str],
    tokenizer,
    out: str,
    seq_len: int = 32768,
    min_tokens: int = 1024,
    max_tokens: int | None = None,
    text_field: str = "text",
    messages_field: str = "messages",
    split: str = "train",
    hf_config: str | None = None,
    max_rows: int | None = None,
    max_chars: int = 16_000_000,
    shard_tokens: int = 1 << 27,
    overwrite: bool = False,
    progress: bool = True,
) -> Manifest:
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if max_tokens is not None and max_tokens < min_tokens:
        raise ValueError(f"max_tokens ({max_tokens}) < min_tokens ({min_tokens})")
    if not sources:
        raise ValueError("give at least one --source")
    for source in sources:  # before PrepRun creates --out
        check_source(source)
    run = PrepRun(
        out=out,
        stage="stage2",
        source=",".join(sources),
        tokenizer=tokenizer,
        seq_len=seq_len,
        packed=True,
        has_loss_mask=False,
        overwrite=overwrite,
        shard_tokens=shard_tokens,
        progress=progress,
    )
    packer = Packer(seq_len, tokenizer.eos_token_id)
    kept_per_source: Counter = Counter()
    has_template = getattr(tokenizer, "chat_template", None) is not None

    def texts(source: str):
        for row in limit(iter_source(source, split=split, hf_config=hf_config), max_rows):
            if row.record is None:
                run.reject(row.reason)
                continue
            if row.record.get(messages_field) is not None:
                messages, reason = check_messages(row.record[messages_field], max_chars=max_chars)
                if reason is None and not has_template:
                    reason = "no_chat_template"
                if reason is not None:
                    run.reject(reason)
                    continue
                # The rendered template already carries the tokenizer's special tokens (BOS, turn markers).
                yield tokenizer.apply_chat_template(messages, tokenize=False), False
            else:
                text, reason = check_text(row.record.get(text_field), max_chars=max_chars)
                if reason is not None:
                    run.reject(reason)
                    continue
                yield text, True

    for source in sources:
        kept_per_source[source] += 0  # a source with no usable row is listed (and refused below), not dropped
        kept_before, rejected_before = kept_per_source[source], Counter(run.stats.rejected)
        for batch in batched(texts(source), 64):
            for text, add_special in batch:
                ids = tokenizer(text, add_special_tokens=add_special)["input_ids"]
                if len(ids) < min_tokens:
                    run.reject("too_short")
                    continue
                if max_tokens is not None and len(ids) > max_tokens:
                    run.reject("too_long")
                    continue
                run.keep()
                kept_per_source[source] += 1
                for packed_row in packer.add(ids):
                    run.writer.add(packed_row)
        if kept_per_source[source] == kept_before:
            # One dead source silently changes the mix (a domain vanishes): refuse, naming it and why.
            rejected = run.stats.rejected - rejected_before
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(rejected.items())) or "no rows at all"
            run.bar.close()
            raise UserError(f"source {source!r} has no usable row ({reasons}); fix or drop it from --source")
    return run.finish(
        tail_tokens_dropped=packer.tail_tokens,
        min_tokens=min_tokens,
        max_tokens=max_tokens,
        kept_per_source=dict(kept_per_source),
    )


def _main(argv: list[str]) -> None:
    parser = ArgumentParser(prog="python -m data_prep.stage2", description=__doc__.split("\n\n")[0])
    add_common_args(parser, repeat_source=True)  # one stage-2 mix from several domains
    parser.set_defaults(max_chars=16_000_000)
    parser.add_argument("--seq-len", type=int, default=32768, help="row length (32768 or 65536 in the paper)")
    parser.add_argument("--min-tokens", type=int, default=1024, help="reject shorter documents")
    parser.add_argument("--max-tokens", type=int, default=None, help="reject longer documents")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--messages-field", default="messages")
    args = parser.parse_args(argv)
    prepare_stage2(
        sources=args.source,
        seq_len=args.seq_len,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        text_field=args.text_field,
        messages_field=args.messages_field,
        split=args.split,
        hf_config=args.hf_config,
        **common_kwargs(args),
    )


def main(argv: list[str] | None = None) -> int:
    """The CLI: exit status 0, or 2 with one `error:` line on stderr for a user error (`--debug`: traceback)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
