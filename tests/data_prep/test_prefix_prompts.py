"""Pipeline data glue in data_prep: stage-3 code-prefix prompts and stage-3 SFT rows cut at --max-new-tokens."""

from __future__ import annotations

import json

from data_prep.prefix_prompts import write_prefix_prompts
from longspec.pipeline import CODE_TARGET


def test_write_prefix_prompts(tmp_path):
    texts = [f"# file {i}\n" + "".join(f"x_{i}_{j} = {j}\n" for j in range(200)) for i in range(5)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": t, "path": f"m{i}.py"}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "p" / "prompts.jsonl"
    assert write_prefix_prompts(str(train), str(out), num_prompts=3, max_chars=500) == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and len({r["id"] for r in rows}) == 3
    for row in rows:
        context = row["context"]
        assert 0 < len(context) <= 500 and not context.endswith("\n")
        assert any(t.startswith(context + "\n") for t in texts)  # a prefix cut at a line end


def test_stage3_sft_keeps_cut_continuations_without_eos(tmp_path):
    """The pipeline's stage 3 trains on target continuations cut at --max-new-tokens: kept with --keep-unfinished,
    and not closed by an EOS they never had; finished rows still end with EOS."""
    from transformers import AutoTokenizer

    from data_prep.stage3_sft import prepare_stage3_sft
    from longspec.data.shards import ShardReader

    tokenizer = AutoTokenizer.from_pretrained(CODE_TARGET)
    rows = [
        {"context": "def f(x):", "response": "    return x + 1", "finished": False},
        {"context": "import os", "response": "\nimport sys", "finished": True},
    ]
    src = tmp_path / "regen.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for keep, kept in ((False, 1), (True, 2)):
        out = tmp_path / f"keep_{keep}"
        manifest = prepare_stage3_sft(
            source=str(src), tokenizer=tokenizer, out=str(out), template="plain", keep_unfinished=keep,
            progress=False,
        )  # fmt: skip
        assert manifest.rows["kept"] == kept
    reader = ShardReader(tmp_path / "keep_True")
    responses = [reader.row(i)[0][reader.row(i)[1]].tolist() for i in range(len(reader))]
    assert responses[0][-1] != tokenizer.eos_token_id
    assert tokenizer.decode(responses[0]) == "    return x + 1"
    assert responses[1][-1] == tokenizer.eos_token_id
