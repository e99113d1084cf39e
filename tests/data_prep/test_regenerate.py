"""Target-regenerated stage-3 responses: batched generation, resume from the output file, then SFT prep."""

from __future__ import annotations

import json

import pytest

from data_prep.stage3_regenerate import read_done_ids, regenerate
from data_prep.stage3_sft import prepare_stage3_sft
from longspec.data import ShardReader
from longspec.testing import build_byte_tokenizer, save_tiny_target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target("llama", tmp_path_factory.mktemp("target"))


def test_regenerate_resumes_and_feeds_stage3(tmp_path, target_dir):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "context": "ctx " * (i + 1), "prompt": f"question {i}"} for i in range(4)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    out = tmp_path / "regen.jsonl"
    common = dict(
        source=str(prompts), target=target_dir, out=str(out), max_new_tokens=3, batch_size=2, progress=False
    )

    stats = regenerate(**common, max_rows=2)
    assert stats.kept == 2
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["id"] for r in first} == {"p0", "p1"}
    # A run killed mid-write leaves half a line: it is dropped and that prompt is answered again.
    with open(out, "a") as f:
        f.write('{"id": "p2", "resp')
    assert read_done_ids(str(out)) == {"p0", "p1"}
    stats = regenerate(**common)
    assert stats.kept == 2 and stats.rejected == {"already_done": 2, "malformed_json": 1}
    final = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in final[:2]] == [r["id"] for r in first]
    assert sorted(r["id"] for r in final) == ["p0", "p1", "p2", "p3"]
    assert all(isinstance(r["response"], str) and isinstance(r["finished"], bool) for r in final)

    # Greedy is deterministic: a fresh run answers the same.
    fresh = tmp_path / "fresh.jsonl"
    regenerate(**{**common, "out": str(fresh)})
    by_id = {json.loads(line)["id"]: json.loads(line)["response"] for line in fresh.read_text().splitlines()}
    assert by_id == {r["id"]: r["response"] for r in final}

    # Force every answer to count as finished so the SFT prep keeps them (3 random tokens rarely end with EOS).
    out.write_text("".join(json.dumps({**r, "finished": True}) + "\n" for r in final))
    manifest = prepare_stage3_sft(
        source=str(out),
        tokenizer=build_byte_tokenizer(),
        out=str(tmp_path / "sft"),
        max_len=256,
        progress=False,
    )
    kept_nonempty = sum(1 for r in final if r["response"].strip())
    assert manifest.rows["kept"] == kept_nonempty and len(ShardReader(tmp_path / "sft")) == kept_nonempty
