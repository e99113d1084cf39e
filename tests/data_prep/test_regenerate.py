"""Target-regenerated stage-3 responses: batched generation, resume from the output file, then SFT prep."""

from __future__ import annotations

import json

import pytest
import torch

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


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)  # on CUDA: static cache + CUDA graphs, as the GPU pipeline runs it
def test_each_answer_is_the_targets_own_greedy_decoding_of_that_prompt_alone(
    tmp_path, target_dir, monkeypatch, device
):
    """Batched, ragged prompts (decoded together by the engine) get the tokens the target gives each prompt on
    its own: HF greedy decoding of that one prompt, no padding anywhere. Compared as token ids (the byte
    tokenizer's text of random tokens is mostly replacement characters), then as the written text."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from transformers import AutoModelForCausalLM

    import data_prep.stage3_regenerate as regen
    from data_prep.common import load_tokenizer

    decoded = {}  # prompt ids -> the engine's tokens, as regenerate received them
    generate_batch = regen.SpeculativeEngine.generate_batch

    def spy(self, prompts, config, **kwargs):
        results = generate_batch(self, prompts, config, **kwargs)
        decoded.update({tuple(p): r.tokens for p, r in zip(prompts, results, strict=True)})
        return results

    monkeypatch.setattr(regen.SpeculativeEngine, "generate_batch", spy)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "context": "word " * (3 + 7 * i), "prompt": f"q{i}"} for i in range(5)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "regen.jsonl"
    regenerate(
        source=str(prompts), target=target_dir, out=str(out), max_new_tokens=6, batch_size=3, progress=False,
        device=device, dtype="float32",
    )  # fmt: skip
    assert len(decoded) == len(rows)  # two batches (3 + 2), every prompt a different length
    tokenizer = load_tokenizer(target_dir)
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval().to(device)
    written = {r["id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    for ids, tokens in decoded.items():
        new = hf.generate(
            torch.tensor([ids], device=device),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
        )[0, len(ids) :].tolist()
        assert tokens == new
    assert sorted(written.values()) == sorted(
        tokenizer.decode(t, skip_special_tokens=True) for t in decoded.values()
    )
