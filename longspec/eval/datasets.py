"""Evaluation data: LongBench long-output tasks, math sets, or a local JSONL in LongBench's row schema.

Every source becomes a list of `Sample`s (an id and the tokenised prompt) after the paper's length filter
(docs/ALGORITHM.md §5): LongBench prompts with min_prompt_tokens < length <= context_len - context_margin (1200 and 2000 in
the paper). Malformed rows (invalid JSON, not UTF-8, lone surrogates, untokenizable text, missing fields) are
counted and skipped, never fatal, and listed (file line and reason) in the run's report; a source left with no
sample at all is one clear error saying how many rows were malformed and how many were filtered by length.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field

from longspec.eval.prompts import LONGBENCH_TEMPLATES, longbench_prompt, math_messages, uses_chat

__all__ = [
    "Sample",
    "DataReport",
    "LONGBENCH_TASKS",
    "MATH_SETS",
    "KNOWN_DATASETS",
    "load_samples",
    "read_jsonl",
    "prompt_context_len",
    "recorded_prompts",
    "encode_row",
]

logger = logging.getLogger(__name__)

LONGBENCH_TASKS: tuple[str, ...] = tuple(LONGBENCH_TEMPLATES)
LONGBENCH_HUB_ID = "THUDM/LongBench"


@dataclass(frozen=True)
class MathSource:
    hub_id: str
    split: str
    id_range: tuple[int, int] | None = None  # inclusive range of the `id` column to keep


MATH_SETS: dict[str, MathSource] = {
    "aime24": MathSource(
        "AI-MO/aimo-validation-aime", "train", id_range=(60, 89)
    ),  # the 30 AIME 2024 problems
    "amc": MathSource("AI-MO/aimo-validation-amc", "train"),
    "math500": MathSource("HuggingFaceH4/MATH-500", "test"),
    "minerva_math": MathSource("math-ai/minervamath", "test"),
}
KNOWN_DATASETS: tuple[str, ...] = LONGBENCH_TASKS + tuple(MATH_SETS)


@dataclass
class Sample:
    id: str
    dataset: str
    prompt_ids: list[int]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass
class DataReport:
    """What happened to the rows of one source: kept, filtered by length, malformed (line, reason)."""

    source: str
    num_rows: int = 0
    num_kept: int = 0
    num_filtered: int = 0
    malformed: list[tuple[int, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "num_rows": self.num_rows,
            "num_kept": self.num_kept,
            "num_filtered_by_length": self.num_filtered,
            "num_malformed": len(self.malformed),
            "malformed": [{"line": line, "reason": reason} for line, reason in self.malformed],
        }


def read_jsonl(path: str) -> tuple[list[tuple[int, dict]], list[tuple[int, str]]]:
    """Rows of a LongBench-schema JSONL: ([(line, row)], [(line, why malformed)]). A row needs string `context`
    and `input` fields (`input` may be empty); `_id`, `answers`, `dataset`, `length` are optional."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"data.path={path!r} is not a file (expected a JSONL in LongBench's row schema)"
        )
    with open(path, "rb") as f:  # bytes: one line that is not UTF-8 is that row's problem, not the file's
        return _parse_jsonl(f)


def _parse_jsonl(lines: Iterable[bytes | str]) -> tuple[list[tuple[int, dict]], list[tuple[int, str]]]:
    rows, malformed = [], []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except UnicodeDecodeError as e:
            malformed.append((line_no, f"not UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start})"))
            continue
        except json.JSONDecodeError as e:
            malformed.append((line_no, f"invalid JSON: {e.msg}"))
            continue
        if not isinstance(row, dict):
            malformed.append((line_no, f"expected a JSON object, got {type(row).__name__}"))
            continue
        missing = [k for k in ("context", "input") if not isinstance(row.get(k), str)]
        if missing:
            malformed.append((line_no, f"missing or non-string field(s): {', '.join(missing)}"))
            continue
        # The optional fields that choose the prompt: a `dataset` that is not a string crashed the template
        # lookup, and a `chat` of "false" (a string, so truthy) chat-wrapped the row.
        wrong = [
            k
            for k, kind in (("dataset", str), ("chat", bool))
            if not isinstance(row.get(k), (kind, type(None)))
        ]
        if wrong:
            malformed.append(
                (line_no, f"wrong type of field(s): {', '.join(wrong)} (dataset: a string, chat: true/false)")
            )
            continue
        if reason := _not_text(row["context"], row["input"]):
            malformed.append((line_no, reason))
            continue
        rows.append((line_no, row))
    return rows, malformed


def _not_text(*values: str) -> str | None:
    """Why strings are not encodable text (JSON's "\\ud800" escapes decode to lone surrogates, which no
    tokenizer accepts), or None."""
    for value in values:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"not valid Unicode text ({e.reason} at character {e.start})"
    return None


def _longbench_rows(task: str) -> tuple[list[tuple[int, dict]], list[tuple[int, str]]]:
    """LongBench's test split of `task`: through `datasets` when it can, else (datasets >= 4 no longer runs
    LongBench's loading script) from the repository's data.zip, member data/<task>.jsonl."""
    try:
        from datasets import load_dataset

        return [
            (i, dict(row)) for i, row in enumerate(load_dataset(LONGBENCH_HUB_ID, task, split="test"))
        ], []
    except Exception as first:  # script datasets unsupported, offline, ...
        try:
            from huggingface_hub import hf_hub_download

            archive = hf_hub_download(LONGBENCH_HUB_ID, "data.zip", repo_type="dataset")
            with zipfile.ZipFile(archive) as zf, zf.open(f"data/{task}.jsonl") as f:
                return _parse_jsonl(f)
        except Exception as e:
            raise ValueError(
                f"could not load {LONGBENCH_HUB_ID}/{task} ({type(first).__name__}: {first}; then data.zip: "
                f"{type(e).__name__}: {e}); download data.zip from the dataset page and pass "
                f"data.path=data/{task}.jsonl"
            ) from e


def _encode_text(tokenizer, text: str) -> list[int]:
    # LongBench tokenises the prompt as plain text with the tokenizer's special tokens (BOS) added.
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def encode_row(tokenizer, row: dict, task: str | None) -> list[int]:
    """The prompt ids of a LongBench-schema row: the task's template filled with the row, as raw text, or -- a
    row with `"chat": true` (the instruct suite, data_prep.instruct_suite) and a task LongBench chat-wraps --
    as one user turn of the target's chat template plus its generation prompt."""
    prompt = longbench_prompt(task, row["context"], row["input"])
    if uses_chat(task, row.get("chat")):
        return _encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return _encode_text(tokenizer, prompt)


def _encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the prompt needs the target's chat template (math / a chat row), but its tokenizer has none"
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _load_hub(hub_id: str, split: str):
    from datasets import load_dataset

    try:
        return load_dataset(hub_id, split=split)
    except Exception as e:  # offline, missing script support, gated: say what to do instead
        raise ValueError(
            f"could not load {hub_id} ({type(e).__name__}: {e}); it needs the Hugging Face hub (or its cache): "
            "unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE or populate the cache first"
        ) from e


def load_samples(
    source: str,
    tokenizer,
    *,
    context_len: int,
    min_prompt_tokens: int | None,
    context_margin: int,
    template: str | None = None,
) -> tuple[list[Sample], DataReport]:
    """source: a LongBench task, a math set name (KNOWN_DATASETS) or a JSONL path.

    min_prompt_tokens None = the source's default (1200 for LongBench and JSONL, 0 for math). template: the
    LongBench task whose template formats JSONL rows (default: each row's `dataset` field, else generic)."""
    if template is not None and template not in LONGBENCH_TASKS:
        raise ValueError(f"data.template={template!r} is not one of LongBench's tasks {LONGBENCH_TASKS}")
    report = DataReport(source=source)
    candidates: list[Sample] = []
    if source in MATH_SETS:
        spec = MATH_SETS[source]
        minimum = 0 if min_prompt_tokens is None else min_prompt_tokens
        for index, row in enumerate(_load_hub(spec.hub_id, spec.split)):
            row_id = row.get("id", index)
            if spec.id_range is not None and not spec.id_range[0] <= int(row_id) <= spec.id_range[1]:
                continue  # outside the subset (AIME: the 2024 problems only): not a row of this source
            report.num_rows += 1
            problem = row.get("problem") or row.get("question")
            if not isinstance(problem, str):
                report.malformed.append((index, "no string `problem` / `question` field"))
                continue
            if reason := _not_text(problem):
                report.malformed.append((index, reason))
                continue
            candidates.append(Sample(str(row_id), source, _encode_chat(tokenizer, math_messages(problem))))
    else:
        minimum = 1200 if min_prompt_tokens is None else min_prompt_tokens
        if source in LONGBENCH_TASKS:
            rows, report.malformed = _longbench_rows(source)
            default_task = source
        else:
            rows, report.malformed = read_jsonl(source)
            default_task = None
        report.num_rows += len(report.malformed)
        dataset_name = source if default_task else os.path.splitext(os.path.basename(source))[0]
        for line, row in rows:
            report.num_rows += 1
            task = template or default_task or row.get("dataset")
            if uses_chat(task, row.get("chat")) and not getattr(tokenizer, "chat_template", None):
                # Not a bad row but the wrong target for this data: say so once, do not skip every row.
                raise ValueError(
                    f"{source}: rows ask for the target's chat template, but its tokenizer has none"
                )
            try:
                ids = encode_row(tokenizer, row, task)
            except (
                TypeError,
                ValueError,
                UnicodeError,
            ) as e:  # text this tokenizer cannot encode: skip the row
                report.malformed.append((line, f"untokenizable: {type(e).__name__}: {e}"))
                continue
            candidates.append(Sample(str(row.get("_id", line)), dataset_name, ids))
        report.malformed.sort()
    _make_ids_unique(candidates, source)
    maximum = context_len - context_margin
    if maximum < 1:
        raise ValueError(
            f"data.context_margin={context_margin} leaves no room for a prompt in a {context_len}-token context"
        )
    samples = [s for s in candidates if minimum < s.prompt_len <= maximum]
    report.num_filtered = len(candidates) - len(samples)
    report.num_kept = len(samples)
    if report.malformed:
        logger.warning(
            "%s: skipped %d malformed row(s), first: line %d: %s",
            source,
            len(report.malformed),
            *report.malformed[0],
        )
    if not samples:
        too_long = sum(s.prompt_len > maximum for s in candidates)
        raise ValueError(_no_samples_message(report, minimum, maximum, too_long=too_long))
    return samples, report


def _make_ids_unique(samples: list[Sample], source: str) -> None:
    """Give a sample whose id repeats an earlier one's the id `ID#k` (its k-th occurrence). The report matches
    each method's output to the reference's by id: two rows with one `_id` (or a row whose `_id` is another
    row's line number, the id of a row without one) made one of them count as a lossless-check failure."""
    seen: set[str] = set()
    renamed = 0
    for sample in samples:
        base, k = sample.id, 1
        while sample.id in seen:
            k += 1
            sample.id = f"{base}#{k}"
        renamed += sample.id != base
        seen.add(sample.id)
    if renamed:
        logger.warning("%s: %d row(s) repeat an earlier row's id: renamed ID#k", source, renamed)


def _no_samples_message(report: DataReport, minimum: int, maximum: int, *, too_long: int = 0) -> str:
    """Why a source gave nothing to evaluate, by count: empty, malformed, or outside the length window (too
    short, too long: the remedies differ)."""
    counts = (
        f"{report.num_rows} rows: {len(report.malformed)} malformed, "
        f"{report.num_filtered} outside the length filter {minimum} < tokens <= {maximum}"
    )
    if report.num_rows == 0:
        hint = "the source is empty"
    elif report.num_filtered == 0:
        line, reason = report.malformed[0]
        hint = f"every row is malformed (first: line {line}: {reason})"
    elif too_long == report.num_filtered:
        # Lowering data.min_prompt_tokens, the only advice given before, does nothing for prompts too long.
        hint = (
            f"every prompt is longer than {maximum} tokens: lower data.context_margin, or raise data.context_len "
            "if the target's context allows"
        )
    elif too_long == 0:
        hint = "every prompt is too short: lower data.min_prompt_tokens (default 1200 for LongBench / JSONL)"
    else:
        hint = "lower data.min_prompt_tokens (default 1200 for LongBench / JSONL) or data.context_margin"
    return f"data source {report.source!r} has no sample to evaluate ({counts}); {hint}"


def prompt_context_len(context_len: int | None, hf_config) -> int | None:
    """The context length prompts are fitted to (`load_samples`): the user's `data.context_len`, else the
    target's max_position_embeddings or, where shorter, the range its rope rotates exactly; None if neither is
    known."""
    from longspec.modules.rope import exact_positions

    bounds = [
        n for n in (getattr(hf_config, "max_position_embeddings", None), exact_positions(hf_config)) if n
    ]
    return context_len or (min(bounds) if bounds else None)


def recorded_prompts(
    data: dict, tokenizer, data_dir: str | None = None, *, context_len: int | None = None
) -> dict[tuple[str, str], list[int]]:
    """(dataset, sample id) -> prompt ids of a recorded evaluation's samples (its results.json `config.data`),
    tokenized again the way the evaluation did (`load_samples`), for tools that re-read a run without decoding it
    again. `data_dir`: where its JSONL files are now, found by file name, when the recorded paths are gone (a run
    made on another machine). `context_len`: the one the run used where `data` sets none (`prompt_context_len`)."""
    context_len = data["context_len"] or context_len
    if context_len is None:
        raise ValueError("the evaluation set no data.context_len and none was given")
    prompts = {}
    if data.get("path"):  # it wins over `name` (DataEvalConfig.sources)
        sources = [data["path"]]
    else:
        sources = data["name"] if isinstance(data["name"], list) else [data["name"]]
    for source in sources:
        if data_dir is not None and not os.path.isfile(source):
            source = os.path.join(data_dir, os.path.basename(source))
        samples, _ = load_samples(
            source, tokenizer, context_len=context_len, min_prompt_tokens=data["min_prompt_tokens"],
            context_margin=data["context_margin"], template=data.get("template"),
        )  # fmt: skip
        prompts.update({(s.dataset, str(s.id)): s.prompt_ids for s in samples})
    return prompts
