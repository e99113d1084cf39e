"""Stage-3 prompts for the code target: code prefixes of training files, which the target then continues.

Used in-process by the pipeline's `stage3_prompts` step (`python -m longspec.pipeline --preset cpu`)."""

from __future__ import annotations

import hashlib
import json
import os
import random

from longspec.ownership import claim_output_file

__all__ = ["write_prefix_prompts"]


def write_prefix_prompts(
    train_jsonl: str, out: str, *, num_prompts: int, max_chars: int, seed: int = 0
) -> int:
    """Stage-3 prompt rows {"id", "context"}: a code prefix (cut at a line end, at most `max_chars`) of each of
    `num_prompts` training files picked at random. The target then writes the continuation (stage3_regenerate), so
    stage 3 teaches the drafter the target's own distribution on code completion, the evaluated task."""
    if not os.path.isfile(train_jsonl):
        raise FileNotFoundError(
            f"{train_jsonl} not found: build the corpus first (python -m data_prep.stdlib_corpus)"
        )
    rows = []
    with open(train_jsonl, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if len(record["text"]) >= max_chars // 2:
                rows.append(record)
    if not rows:
        raise ValueError(f"{train_jsonl} has no file of at least {max_chars // 2} characters")
    rng = random.Random(seed)
    rng.shuffle(rows)
    claim_output_file(out, "prefix-prompts")
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for record in rows[:num_prompts]:
            text = record["text"]
            # A random cut in the file's first `max_chars`, at a line end: prompts end mid-file, not all at the
            # header. The plain template appends "\n", so the prefix is given without its last newline.
            limit = min(len(text), max_chars)
            cut = text.rfind("\n", 0, rng.randint(limit // 2, limit))
            context = text[: max(cut, 1)].rstrip("\n")
            row_id = hashlib.sha256(record.get("path", text[:64]).encode()).hexdigest()[:16]
            f.write(json.dumps({"id": row_id, "context": context}, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return min(num_prompts, len(rows))
