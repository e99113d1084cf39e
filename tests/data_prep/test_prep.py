"""Prep of good and bad sources for the three stages, the shard format, and interrupted preps."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from data_prep.common import iter_source
from data_prep.stage1 import prepare_stage1
from data_prep.stage2 import prepare_stage2
from data_prep.stage3_sft import prepare_stage3_sft
from longspec.data import Manifest, ShardReader, ShardWriter, tokenizer_fingerprint
from longspec.data.loader import IGNORE_INDEX, StepSampler, collate_rows
from longspec.data.shards import prepare_output_dir
from longspec.testing import EOS_ID, build_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return str(path)


def test_shards_round_trip_with_mask(tmp_path):
    rows = [np.arange(5), np.arange(100, 103), np.array([7])]
    masks = [np.array([0, 0, 1, 1, 1]), np.array([1, 1, 1]), np.array([0])]
    writer = ShardWriter(
        tmp_path, token_dtype="uint16", has_loss_mask=True, shard_tokens=6
    )  # forces 2 shards
    for row, mask in zip(rows, masks, strict=True):
        writer.add(row, mask)
    fingerprint = {"vocab_size": 300}
    writer.finish(
        Manifest(
            stage="t",
            source="s",
            seq_len=5,
            packed=False,
            has_loss_mask=True,
            token_dtype="uint16",
            tokenizer=fingerprint,
        )
    )
    reader = ShardReader(tmp_path)
    assert len(reader) == 3 and len(reader.manifest.shards) == 2
    for i in range(3):
        tokens, mask = reader.row(i)
        np.testing.assert_array_equal(tokens, rows[i])
        np.testing.assert_array_equal(mask, masks[i].astype(bool))
    with pytest.raises(IndexError):
        reader.row(3)


def test_collate_labels_follow_the_mask():
    rows = [(np.array([1, 2, 3, 4]), np.array([0, 0, 1, 1], dtype=bool)), (np.array([5, 6]), None)]
    batch = collate_rows(rows, pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]
    # labels[t] is token t+1, kept only where the next token is masked in.
    assert batch.labels.tolist() == [
        [IGNORE_INDEX, 3, 4, IGNORE_INDEX],
        [6, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX],
    ]


def test_stage1_packs_eos_separated_rows(tmp_path, tokenizer):
    docs = [{"text": "def f(x):\n    return x\n" * (i + 1)} for i in range(20)]
    src = write_jsonl(tmp_path / "a.jsonl", docs)
    manifest = prepare_stage1(
        source=src, tokenizer=tokenizer, out=str(tmp_path / "out"), seq_len=32, progress=False
    )
    reader = ShardReader(tmp_path / "out")
    assert (
        manifest.packed
        and manifest.seq_len == 32
        and manifest.rows == {"read": 20, "kept": 20, "rejected": {}}
    )
    assert manifest.tokenizer == tokenizer_fingerprint(tokenizer)
    flat = np.concatenate([reader.row(i)[0] for i in range(len(reader))])
    assert all(reader.row(i)[0].size == 32 for i in range(len(reader)))
    # Every document is BOS + bytes + EOS, back to back: decoding the stream gives the documents in order.
    expected = b"".join(b"\x00" + d["text"].encode() + b"\x01" for d in docs)
    got = bytes({256: 0, 257: 1}.get(int(t), int(t)) for t in flat)
    assert got == expected[: len(got)] and len(expected) - len(got) == manifest.extra["tail_tokens_dropped"]
    assert manifest.num_tokens == flat.size == 32 * len(reader)
    assert (flat == EOS_ID).sum() >= 1


def test_stage1_bad_rows_are_counted_and_skipped(tmp_path, tokenizer):
    rows = [
        {"text": "good document " * 10},
        "{not json",
        "[1, 2]",
        {"nottext": "x"},
        {"text": 5},
        {"text": "   "},
        {"text": "bin\x00ary"},
        {"text": "y" * 5000},
        {"text": "another good one " * 10},
    ]
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    manifest = prepare_stage1(
        source=src, tokenizer=tokenizer, out=str(tmp_path / "out"), seq_len=16, max_chars=1000, progress=False
    )
    assert manifest.rows == {
        "read": 9,
        "kept": 2,
        "rejected": {
            "empty": 1,
            "malformed_json": 1,
            "missing_field": 1,
            "non_text": 1,
            "not_an_object": 1,
            "too_long": 1,
            "wrong_type": 1,
        },
    }


def test_source_with_no_valid_rows_is_one_clear_error(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "bad.jsonl", ["{oops", {"text": ""}, {"body": "x"}])
    with pytest.raises(ValueError, match=r"no valid rows.*malformed_json: 1"):
        prepare_stage1(source=src, tokenizer=tokenizer, out=str(tmp_path / "out"), seq_len=8, progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare_stage1(
            source=str(tmp_path / "nope.jsonl"), tokenizer=tokenizer, out=str(tmp_path / "o2"), progress=False
        )


def test_stage1_directory_and_parquet_sources(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "a.py").write_text("import os\n" * 20)
    (tree / "b.md").write_text("# title\n" * 20)
    (tree / "c.bin").write_bytes(b"\x00\x01")  # not a text extension: not read
    (tree / "d.txt").write_bytes(b"\xff\xfe\x00bad")  # a text extension but not UTF-8
    rows = list(iter_source(str(tree)))
    assert sorted(r.record["path"] for r in rows if r.record) == ["b.md", "pkg/a.py"]
    assert [r.reason for r in rows if r.record is None] == ["non_text"]
    pq.write_table(pa.table({"text": ["x = 1\n" * 30, None]}), tmp_path / "t.parquet")
    manifest = prepare_stage1(
        source=str(tmp_path / "t.parquet"),
        tokenizer=tokenizer,
        out=str(tmp_path / "o"),
        seq_len=16,
        progress=False,
    )
    assert manifest.rows["kept"] == 1 and manifest.rows["rejected"] == {"missing_field": 1}


def test_stage2_renders_conversations_and_filters_length(tmp_path, tokenizer):
    rows = [
        {"text": "long book chapter. " * 20},
        {"text": "short"},
        {
            "messages": [
                {"role": "user", "content": "summarise " * 10},
                {"role": "assistant", "content": "ok " * 10},
            ]
        },
        {"messages": [{"role": "user"}]},
        {"messages": "not a list"},
    ]
    src = write_jsonl(tmp_path / "long.jsonl", rows)
    manifest = prepare_stage2(
        sources=[src], tokenizer=tokenizer, out=str(tmp_path / "o"), seq_len=64, min_tokens=50, progress=False
    )
    assert manifest.rows["kept"] == 2
    assert manifest.rows["rejected"] == {"missing_field": 1, "too_short": 1, "wrong_type": 1}
    reader = ShardReader(tmp_path / "o")
    text = bytes(int(t) for i in range(len(reader)) for t in reader.row(i)[0] if t < 256).decode()
    assert "### user:\nsummarise" in text  # the chat template was applied


def test_stage3_sft_masks_only_the_response(tmp_path, tokenizer):
    rows = [
        {"context": "A long report. " * 5, "prompt": "Summarise it.", "response": "It is long."},
        {"prompt": "Hi", "response": ""},
        {"context": "no response"},
        {"prompt": "too long " * 50, "response": "x"},
        {"prompt": "cut", "response": "partial", "finished": False},
    ]
    src = write_jsonl(tmp_path / "sft.jsonl", rows)
    manifest = prepare_stage3_sft(
        source=src, tokenizer=tokenizer, out=str(tmp_path / "o"), max_len=200, progress=False
    )
    assert manifest.has_loss_mask and not manifest.packed
    assert manifest.rows["rejected"] == {"empty": 1, "missing_field": 1, "too_long": 1, "unfinished": 1}
    tokens, mask = ShardReader(tmp_path / "o").row(0)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": rows[0]["context"] + "\n\n" + rows[0]["prompt"]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    trained = tokenizer.decode(tokens[mask].tolist())
    assert trained == "It is long." + tokenizer.eos_token
    assert tokenizer.decode(tokens[~mask].tolist()) == prompt


def test_interrupted_prep_restarts_and_is_never_read(tmp_path, tokenizer):
    out = tmp_path / "o"
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "abc " * 40}])
    prepare_stage1(source=src, tokenizer=tokenizer, out=str(out), seq_len=16, progress=False)
    with pytest.raises(FileExistsError, match="--overwrite"):
        prepare_output_dir(out, overwrite=False)
    # Simulate a prep killed after its first shard: an incomplete manifest and a stray temp file.
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "shard_00001.tokens.bin.tmp-123").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="interrupted prep"):
        ShardReader(out)
    prepare_stage1(source=src, tokenizer=tokenizer, out=str(out), seq_len=16, progress=False)
    assert not any(".tmp-" in name for name in os.listdir(out))
    assert len(ShardReader(out)) == manifest["shards"][0]["num_rows"]


def test_truncated_shard_is_detected(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "abc " * 40}])
    prepare_stage1(source=src, tokenizer=tokenizer, out=str(tmp_path / "o"), seq_len=16, progress=False)
    path = tmp_path / "o" / "shard_00000.tokens.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="corrupt"):
        ShardReader(tmp_path / "o")


@pytest.mark.parametrize(
    "text, message",
    [
        ("hi", r"manifest.json is not valid JSON"),
        ("[1]", r"manifest.json is not a prep manifest \(a JSON list\)"),
        ('{"format_version": 1}', r"manifest.json is not a prep manifest \(.*missing"),
    ],
)
def test_damaged_manifest_names_the_file_and_a_rerun_restarts(tmp_path, tokenizer, text, message):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "abc " * 40}])
    out = tmp_path / "o"
    prepare_stage1(source=src, tokenizer=tokenizer, out=str(out), seq_len=16, progress=False)
    (out / "manifest.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        ShardReader(out)  # what the trainer reads (it printed a bare JSONDecodeError / TypeError before)
    prepare_stage1(source=src, tokenizer=tokenizer, out=str(out), seq_len=16, progress=False)
    assert len(ShardReader(out)) > 0  # the prep treats it as stale: no --overwrite needed


def test_step_sampler_is_a_partition_of_each_epoch(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "abcdefgh" * 50}])
    prepare_stage1(source=src, tokenizer=tokenizer, out=str(tmp_path / "o"), seq_len=8, progress=False)
    reader = ShardReader(tmp_path / "o")
    sampler = StepSampler(reader, global_batch_size=8, micro_batch_size=2, world_size=2, seed=3)
    assert sampler.grad_accum == 2
    seen = [
        int(i)
        for s in range(sampler.steps_per_epoch)
        for m in range(2)
        for r in range(2)
        for i in sampler.rows(s, m, r)
    ]
    assert len(seen) == len(set(seen)) == 8 * sampler.steps_per_epoch  # no row twice within an epoch
    again = StepSampler(reader, global_batch_size=8, micro_batch_size=2, world_size=2, seed=3)
    assert again.rows(5, 1, 1).tolist() == sampler.rows(5, 1, 1).tolist()  # the position is just the step
    with pytest.raises(ValueError, match="not a multiple"):
        StepSampler(reader, global_batch_size=6, micro_batch_size=2, world_size=2, seed=0)


def test_hf_dataset_ids_are_streamed(tmp_path, tokenizer, monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None, streaming=False):
        calls.append((path, name, split, streaming))
        return iter([{"text": "streamed row " * 5, "meta": {}}, {"text": None}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    manifest = prepare_stage1(
        source="DKYoon/SlimPajama-6B",
        tokenizer=tokenizer,
        out=str(tmp_path / "o"),
        seq_len=16,
        split="validation",
        progress=False,
    )
    assert calls == [("DKYoon/SlimPajama-6B", None, "validation", True)]
    assert manifest.source == "DKYoon/SlimPajama-6B" and manifest.rows["rejected"] == {"missing_field": 1}


def test_unreachable_hf_dataset_is_a_clear_error(tmp_path, tokenizer):
    # conftest sets HF_DATASETS_OFFLINE=1: the hub cannot be reached.
    with pytest.raises(FileNotFoundError, match="could not be opened"):
        prepare_stage1(
            source="no-such-user/no-such-dataset",
            tokenizer=tokenizer,
            out=str(tmp_path / "o"),
            progress=False,
        )


def test_cli_entry_points(tmp_path, tokenizer):
    from data_prep import stage1, stage2, stage3_sft

    tokenizer.save_pretrained(tmp_path / "tok")
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "abc " * 100, "messages": None}])
    stage1.main(
        [
            "--source",
            src,
            "--tokenizer",
            str(tmp_path / "tok"),
            "--out",
            str(tmp_path / "o1"),
            "--seq-len",
            "32",
            "--no-progress",
        ]
    )
    stage2.main(
        [
            "--source",
            src,
            "--source",
            src,
            "--tokenizer",
            str(tmp_path / "tok"),
            "--out",
            str(tmp_path / "o2"),
            "--seq-len",
            "64",
            "--min-tokens",
            "10",
            "--no-progress",
        ]
    )
    sft = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "q", "response": "a"}])
    stage3_sft.main(
        [
            "--source",
            sft,
            "--tokenizer",
            str(tmp_path / "tok"),
            "--out",
            str(tmp_path / "o3"),
            "--no-progress",
        ]
    )
    assert Manifest.load(tmp_path / "o1").seq_len == 32
    assert Manifest.load(tmp_path / "o2").rows["kept"] == 2  # the source twice: a two-domain mix
    assert Manifest.load(tmp_path / "o3").has_loss_mask
