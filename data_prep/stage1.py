"""Stage-1 data: short documents -> tokenized, EOS-separated, packed 1024-token rows (docs/ALGORITHM.md §3.5, stage 1).

    python -m data_prep.stage1 --tokenizer TARGET_DIR_OR_ID --out data/stage1 \
        [--source DKYoon/SlimPajama-6B | FILE.jsonl | FILE.parquet | DIR] [--seq-len 1024] [--max-rows N]

The default source is SlimPajama-6B streamed from the Hugging Face hub; any local JSONL/parquet with a `text`
field, or a directory of text/code files (e.g. the Python standard library), works the same way. Each document is
tokenized as the target would see it (the tokenizer's own special tokens, e.g. BOS) and terminated with EOS.
"""

from __future__ import annotations

import sys

from data_prep.common import (
    Packer,
    PrepRun,
    add_common_args,
    batched,
    check_source,
    check_text,
    common_kwargs,
    iter_source,
    limit,
)
from longspec.cli import ArgumentParser, run_cli
from longspec.data.manifest import Manifest

DEFAULT_SOURCE = "DKYoon/SlimPajama-6B"


def prepare_stage1(
    *,
    source: str,
    tokenizer,
    out: str,
    seq_len: int = 1024,
    text_field: str = "text",
    split: str = "train",
    hf_config: str | None = None,
    max_rows: int | None = None,
    max_chars: int = 4_000_000,
    shard_tokens: int = 1 << 27,
    overwrite: bool = False,
    progress: bool = True,
) -> Manifest:
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    check_source(source)  # before PrepRun creates --out
    run = PrepRun(
        out=out,
        stage="stage1",
        source=source,
        tokenizer=tokenizer,
        seq_len=seq_len,
        packed=True,
        has_loss_mask=False,
        overwrite=overwrite,
        shard_tokens=shard_tokens,
        progress=progress,
    )
    packer = Packer(seq_len, tokenizer.eos_token_id)

    def texts():
        for row in limit(iter_source(source, split=split, hf_config=hf_config), max_rows):
            if row.record is None:
                run.reject(row.reason)
                continue
            text, reason = check_text(row.record.get(text_field), max_chars=max_chars)
            if reason is not None:
                run.reject(reason)
                continue
            run.keep()
            yield text

    # Batches go through the fast tokenizer's parallel batch encoder.
    for batch in batched(texts(), 256):
        for ids in tokenizer(batch, add_special_tokens=True)["input_ids"]:
            for packed_row in packer.add(ids):
                run.writer.add(packed_row)
    return run.finish(tail_tokens_dropped=packer.tail_tokens, text_field=text_field)


def _main(argv: list[str]) -> None:
    parser = ArgumentParser(prog="python -m data_prep.stage1", description=__doc__.split("\n\n")[0])
    add_common_args(parser, default_source=DEFAULT_SOURCE)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--text-field", default="text")
    args = parser.parse_args(argv)
    prepare_stage1(
        source=args.source,
        seq_len=args.seq_len,
        text_field=args.text_field,
        split=args.split,
        hf_config=args.hf_config,
        **common_kwargs(args),
    )


def main(argv: list[str] | None = None) -> int:
    """The CLI: exit status 0, or 2 with one `error:` line on stderr for a user error (`--debug`: traceback)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
