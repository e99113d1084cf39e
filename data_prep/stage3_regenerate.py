"""Stage-3 responses written by the target itself, so the drafter learns the target's own distribution.

    python -m data_prep.stage3_regenerate --target TARGET_DIR_OR_ID --source prompts.jsonl \
        --out regenerated.jsonl [--max-new-tokens 1024] [--batch-size 8] [--temperature 0]
    python -m data_prep.stage3_sft --tokenizer TARGET_DIR_OR_ID --source regenerated.jsonl --out data/stage3

Input rows are prompts: {"id"?, "context"?, "prompt"?, "system"?} (context and/or prompt, as in stage3_sft). Each is
rendered with the target's chat template and answered by the target (greedy at --temperature 0, else sampled with
--top-p), in length-sorted batches decoded together by longspec's engine (plain decoding on a static cache, CUDA
graphs on a GPU; each answer is the one the target gives that prompt alone). Output rows are the input row plus
"response" and "finished" (False when
--max-new-tokens cut the answer; stage3_sft rejects those). The output file is its own record of done ids
(the row's "id", else its line number): rerunning the same command skips finished prompts and continues, and a
half-written last line from a killed run is dropped first. An existing --out that is not this tool's output (or is
the --source) is refused untouched. A row whose fields have the wrong type is counted and skipped.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import zlib

import torch
from jinja2 import TemplateError
from tqdm import tqdm

from data_prep.common import batched, iter_source, limit, load_tokenizer, prep_lock
from data_prep.stage3_sft import TEMPLATES, check_template, render_prompt, user_content
from longspec.cli import ArgumentParser, UserError, run_cli
from longspec.data.manifest import RowStats
from longspec.infer import GenerationConfig, SpeculativeEngine
from longspec.target import TargetModel

log = logging.getLogger("data_prep")


def _is_output_row(record) -> bool:
    """A row this tool wrote: the input row plus a str/int "id", a str "response" and a bool "finished"."""
    return (
        isinstance(record, dict)
        and isinstance(record.get("id"), (str, int))
        and isinstance(record.get("response"), str)
        and isinstance(record.get("finished"), bool)
    )


def read_done_ids(path: str) -> set[str]:
    """Ids already answered in `path`, this tool's own output (a rerun resumes from it).

    Every complete line is checked to be an output row BEFORE anything is written: any other file (a prompt
    file, a user's JSONL) is refused untouched. Only then is a trailing partial line -- a row a killed run
    was writing -- cut off, to be regenerated."""
    if not os.path.exists(path):
        return set()
    if not os.path.isfile(path):
        raise UserError(f"--out {path!r} is not a file")
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    done = set()
    for number, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if not _is_output_row(record):
            raise UserError(
                f"--out {path!r} line {number} is not a stage3_regenerate output row (id, response, finished): "
                "refusing to append to another file; choose a new --out"
            )
        done.add(str(record["id"]))
    if end != len(data):
        if not done:  # nothing shows the file is ours: a user's one-line file without a newline, say
            raise UserError(
                f"--out {path!r} holds no complete output row, only an unterminated line: not touching it; "
                "delete it if a killed run left it"
            )
        with open(path, "rb+") as f:
            f.truncate(end)  # the last row was cut mid-write: drop it, it is regenerated
    return done


def _check_out_is_not_source(source: str, out: str) -> None:
    if os.path.exists(out) and os.path.exists(source) and os.path.samefile(out, source):
        raise UserError(f"--out {out!r} is the --source file: write the responses to a new file")
    if os.path.isdir(source) and os.path.realpath(out).startswith(os.path.realpath(source) + os.sep):
        raise UserError(f"--out {out!r} lies inside the --source directory {source!r}: choose another place")


def regenerate(
    *,
    source: str,
    target: str,
    out: str,
    max_new_tokens: int = 1024,
    batch_size: int = 8,
    temperature: float = 0.0,
    top_p: float = 1.0,
    template: str = "chat",
    max_prompt_tokens: int | None = None,
    max_rows: int | None = None,
    max_chars: int = 4_000_000,
    seed: int = 0,
    device: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> RowStats:
    if max_new_tokens < 1 or batch_size < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise ValueError("need max_new_tokens >= 1, batch_size >= 1, temperature >= 0 and 0 < top_p <= 1")
    _check_out_is_not_source(source, out)
    tokenizer = load_tokenizer(target, trust_remote_code=trust_remote_code)
    check_template(tokenizer, template)
    done = read_done_ids(out)
    stats = RowStats()
    pending = []  # (id, row, prompt ids)
    for index, row in enumerate(limit(iter_source(source), max_rows)):
        if row.record is None:
            stats.reject(row.reason)
            continue
        content, reason = user_content(row.record, max_chars=max_chars)
        if reason is not None:
            stats.reject(reason)
            continue
        system = row.record.get("system")
        if system is not None and not isinstance(system, str):
            stats.reject("wrong_type")  # as stage3_sft does: a row problem, not the run's
            continue
        row_id = str(row.record.get("id", index))
        if row_id in done:
            stats.reject("already_done")
            continue
        try:
            prompt = render_prompt(tokenizer, content, system=system, template=template)
        except (
            TemplateError
        ) as e:  # the template's own raise_exception (e.g. "no system role"): this row only
            log.debug("row %s: chat template refused it: %s", row_id, e)
            stats.reject("template_error")
            continue
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            stats.reject("too_long")
            continue
        stats.keep()
        pending.append((row_id, row.record, ids))
    if stats.kept == 0 and not done:
        raise ValueError(f"source {source!r} has no valid prompt rows: {stats.summary()}")
    log.info("regenerate: %s; %d already done", stats.summary(), len(done))

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")  # TargetModel checks the name
    # The engine's batched plain decoding (static cache, CUDA graphs on a GPU): each row's answer is the one the
    # target writes for that prompt alone (tests/infer), with no padding inside any row; HF's padded batched
    # generate, used before, took 154 s of a 10-minute GPU run for 256 answers of SmolLM2-135M.
    model = TargetModel.from_pretrained(
        target, dtype=dtype, device=device, trust_remote_code=trust_remote_code
    )
    model.check_tokenizer(tokenizer)
    engine = SpeculativeEngine(model)
    eos = tokenizer.eos_token_id
    # Length-sorted batches: rows of similar lengths share a cache size.
    pending.sort(key=lambda item: len(item[2]))
    bar = tqdm(total=len(pending), desc="regenerate", unit=" prompts", disable=not progress)
    with open(out, "a", encoding="utf-8") as f:
        for batch in batched(pending, batch_size):
            config = GenerationConfig(
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p if temperature > 0 else None,
                eos_token_ids=() if eos is None else (eos,),
                # Seeded by the batch's first id (not its index, which shifts on resume): reruns are reproducible.
                seed=seed + zlib.crc32(batch[0][0].encode()),
                cuda_graphs=engine.device.type == "cuda",
                static_shapes=True,
            )
            results = engine.generate_batch([ids for _, _, ids in batch], config, method="ar")
            for (row_id, record, _), result in zip(batch, results, strict=True):
                new_ids = result.tokens
                finished = eos is not None and eos in new_ids
                if finished:
                    new_ids = new_ids[: new_ids.index(eos)]
                response = tokenizer.decode(new_ids, skip_special_tokens=True)
                f.write(
                    json.dumps(
                        {**record, "id": row_id, "response": response, "finished": finished},
                        ensure_ascii=False,
                    )
                    + "\n"
                )
            f.flush()  # a batch is done once its rows are on disk
            os.fsync(f.fileno())
            bar.update(len(batch))
    bar.close()
    print(f"{stats.summary()}; answered {len(pending)} prompts -> {out}")
    return stats


def _main(argv: list[str]) -> None:
    parser = ArgumentParser(
        prog="python -m data_prep.stage3_regenerate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--source", required=True, help="prompt rows: .jsonl/.parquet file or HF dataset id")
    parser.add_argument("--target", required=True, help="the target model (local dir, hub id or .gguf file)")
    parser.add_argument("--out", required=True, help="output .jsonl (appended to; rerun to resume)")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--template", choices=TEMPLATES, default="chat")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="reject longer prompts")
    parser.add_argument("--max-rows", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    with prep_lock(args.out, file=True):  # one writer per --out: a second one would append the same answers
        regenerate(
            source=args.source,
            target=args.target,
            out=args.out,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            temperature=args.temperature,
            top_p=args.top_p,
            template=args.template,
            max_prompt_tokens=args.max_prompt_tokens,
            max_rows=args.max_rows,
            seed=args.seed,
            device=args.device,
            dtype=args.dtype,
            trust_remote_code=args.trust_remote_code,
            progress=not args.no_progress,
        )


def main(argv: list[str] | None = None) -> int:
    """The CLI: exit status 0, or 2 with one `error:` line on stderr for a user error (`--debug`: traceback)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
