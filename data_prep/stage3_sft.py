"""Stage-3 data: long-context SFT rows -> tokenized rows with a loss mask on the response only (docs/ALGORITHM.md §3.5, stage 3).

    python -m data_prep.stage3_sft --tokenizer TARGET_DIR_OR_ID --source sft.jsonl --out data/stage3 \
        [--max-len 32768] [--template chat|plain]

A row is {"context": str, "prompt": str, "response": str} (context or prompt may be absent, not both; an optional
"system" str). The user turn (context, a blank line, then prompt) is rendered with the target's chat template
plus its generation prompt -- exactly what the target is fed at inference -- and the response follows, closed by
EOS. Only response tokens (and the closing EOS) are trained on. Rows longer than --max-len tokens are rejected.
Rows may come from `data_prep.stage3_regenerate` (responses written by the target itself).
"""

from __future__ import annotations

import sys
from typing import Any

from data_prep.common import (
    PrepRun,
    add_common_args,
    check_source,
    check_text,
    common_kwargs,
    iter_source,
    limit,
)
from longspec.cli import ArgumentParser, run_cli
from longspec.data.manifest import Manifest

TEMPLATES = ("chat", "plain")


def user_content(record: dict[str, Any], *, max_chars: int) -> tuple[str | None, str | None]:
    """The user turn of an SFT/prompt row: context, a blank line, prompt -> (text, None) or (None, reason)."""
    parts = []
    for key in ("context", "prompt"):
        if record.get(key) is None:
            continue
        text, reason = check_text(record[key], max_chars=max_chars)
        if reason is not None:
            return None, reason
        parts.append(text)
    if not parts:
        return None, "missing_field"
    return "\n\n".join(parts), None


def render_prompt(tokenizer, content: str, *, system: str | None = None, template: str = "chat") -> str:
    """The prompt text the target sees before it starts answering."""
    if template == "plain":
        # Base models without a chat template: BOS (if any) + the content + a newline, nothing invented.
        return (tokenizer.bos_token or "") + content + "\n"
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}
    ]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def check_template(tokenizer, template: str) -> None:
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    if template == "chat" and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; pass --template plain for a base model")


def prepare_stage3_sft(
    *,
    source: str,
    tokenizer,
    out: str,
    max_len: int = 32768,
    min_response_tokens: int = 1,
    template: str = "chat",
    response_field: str = "response",
    keep_unfinished: bool = False,
    max_rows: int | None = None,
    max_chars: int = 4_000_000,
    shard_tokens: int = 1 << 27,
    overwrite: bool = False,
    progress: bool = True,
) -> Manifest:
    check_template(tokenizer, template)
    check_source(source)  # before PrepRun creates --out
    run = PrepRun(
        out=out,
        stage="stage3_sft",
        source=source,
        tokenizer=tokenizer,
        seq_len=max_len,
        packed=False,
        has_loss_mask=True,
        overwrite=overwrite,
        shard_tokens=shard_tokens,
        progress=progress,
    )
    eos = tokenizer.eos_token_id
    longest = 0
    for row in limit(iter_source(source), max_rows):
        if row.record is None:
            run.reject(row.reason)
            continue
        cut = row.record.get("finished") is False  # stage3_regenerate: the answer was cut at max_new_tokens
        if cut and not keep_unfinished:
            run.reject("unfinished")
            continue
        content, reason = user_content(row.record, max_chars=max_chars)
        response, response_reason = check_text(row.record.get(response_field), max_chars=max_chars)
        system = row.record.get("system")
        reason = (
            reason or response_reason or (None if system is None or isinstance(system, str) else "wrong_type")
        )
        if reason is not None:
            run.reject(reason)
            continue
        prompt_ids = tokenizer(
            render_prompt(tokenizer, content, system=system, template=template), add_special_tokens=False
        )["input_ids"]
        # A cut response did not end there: it gets no closing EOS (code continuations, --keep-unfinished).
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + ([] if cut else [eos])
        if len(response_ids) - (0 if cut else 1) < min_response_tokens:
            run.reject("too_short")
            continue
        if len(prompt_ids) + len(response_ids) > max_len:
            run.reject("too_long")
            continue
        run.keep()
        run.writer.add(prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids))
        longest = max(longest, len(prompt_ids) + len(response_ids))
    return run.finish(template=template, longest_row=longest)


def _main(argv: list[str]) -> None:
    parser = ArgumentParser(prog="python -m data_prep.stage3_sft", description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--max-len", type=int, default=32768, help="reject rows with more tokens")
    parser.add_argument("--min-response-tokens", type=int, default=1)
    parser.add_argument("--template", choices=TEMPLATES, default="chat")
    parser.add_argument("--response-field", default="response")
    parser.add_argument(
        "--keep-unfinished",
        action="store_true",
        help="keep responses cut at stage3_regenerate's --max-new-tokens (e.g. code continuations), without EOS",
    )
    args = parser.parse_args(argv)
    prepare_stage3_sft(
        source=args.source,
        max_len=args.max_len,
        min_response_tokens=args.min_response_tokens,
        template=args.template,
        response_field=args.response_field,
        keep_unfinished=args.keep_unfinished,
        **common_kwargs(args),
    )


def main(argv: list[str] | None = None) -> int:
    """The CLI: exit status 0, or 2 with one `error:` line on stderr for a user error (`--debug`: traceback)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
