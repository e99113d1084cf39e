"""Stage-3 prompts (train split), the instruct eval suite (held-out split) and stage-2 long documents, built from a
small corpus with the byte tokenizer: bucket lengths, split discipline, schemas read back by their consumers."""

import json

import pytest
from registry_fixtures import module, prose

from data_prep.doc_tasks import boundaries, cut_task, fit_prefix, headings, question
from data_prep.instruct_prompts import build_prompts
from data_prep.instruct_suite import DEFAULT_TASKS, SUITE_TASKS, build_suite
from data_prep.long_documents import build_long_documents
from data_prep.stage2 import prepare_stage2
from data_prep.stage3_sft import render_prompt
from longspec.eval.datasets import encode_row, load_samples


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture()
def corpus(tmp_path):
    """Both splits hold long code and prose documents (the byte tokenizer: one token a byte)."""
    out = tmp_path / "corpus"
    out.mkdir()
    for split in ("train", "heldout"):
        rows = []
        for i in range(6):
            rows.append({"text": module(f"{split}{i}", 40 + 10 * i), "source": split, "path": f"pkg/m{i}.py",
                         "kind": "code", "licence": "MIT"})  # fmt: skip
            rows.append({"text": prose(f"{split} guide {i}", 12 + 3 * i), "source": split, "path": f"docs/g{i}.rst",
                         "kind": "prose", "licence": "MIT"})  # fmt: skip
        _write(out / f"{split}.jsonl", rows)
    return out


def test_fit_prefix_is_the_longest_prefix_within_budget():
    text = "".join(f"line {i}\n" for i in range(100))
    ends = boundaries(text, "code")
    prefix = fit_prefix(text, ends, len, 250)
    assert len(prefix) <= 250 < len(prefix) + len("line 99\n") and prefix.endswith("\n")
    assert fit_prefix(text, ends, len, 3) is None


def test_questions_name_something_the_document_contains():
    doc = prose("Guide", 4)
    assert [t for _, t in headings(doc)][:2] == ["Guide", "Configuring part 0"]
    asked = question("k", "prose", doc)
    assert any(f'"{t}"' in asked for _, t in headings(doc)[1:])
    asked = question("k", "code", module("abc", 3))
    assert "`abc_func_" in asked or "`AbcThing`" in asked
    assert question("k", "prose", "no headings here\n") is None


def test_code_cut_ends_at_a_line_and_answers_with_the_next_line():
    doc = {"text": module("z", 50), "kind": "code", "source": "s", "path": "p.py"}
    cut = cut_task("code", doc, lambda c, i: len(c), 2000)
    assert cut["context"].endswith("\n") and len(cut["context"]) <= 2000
    assert cut["answer"] == next(ln for ln in doc["text"][len(cut["context"]) :].splitlines() if ln.strip())


def test_suite_respects_buckets_uses_only_heldout_and_reads_back(corpus, tokenizer, tmp_path):
    out = tmp_path / "suite"
    manifest = build_suite(corpus=corpus, tokenizer=tokenizer, out=out, buckets=[2048, 4096], per_bucket=2,
                           gen_room=512)  # fmt: skip
    assert not manifest["shortfalls"]
    for stem in DEFAULT_TASKS:
        dataset = SUITE_TASKS[stem][0]
        for bucket in (2048, 4096):
            path = out / f"{stem}_{bucket // 1024}k.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            assert len(rows) == 2
            for row in rows:
                assert {
                    "_id",
                    "input",
                    "context",
                    "answers",
                    "length",
                    "dataset",
                    "language",
                    "all_classes",
                } <= set(row)
                assert row["source"] == "heldout" and row["dataset"] == dataset
                assert row["chat"] is (dataset != "lcc")
                # The recorded length is the eval's own tokenisation, and it fills the bucket minus room.
                assert row["prompt_tokens"] == len(encode_row(tokenizer, row, dataset))
                assert 0.8 * (bucket - 512) <= row["prompt_tokens"] <= bucket - 512
            samples, report = load_samples(str(path), tokenizer, context_len=bucket, min_prompt_tokens=0,
                                           context_margin=512)  # fmt: skip
            assert report.num_kept == 2 and not report.malformed
            assert [s.prompt_len for s in samples] == [r["prompt_tokens"] for r in rows]
            text = tokenizer.decode(samples[0].prompt_ids)
            if dataset == "lcc":
                assert text.startswith("<|bos|>Please complete the code given below.")
            else:  # one user turn of the chat template, generation prompt last
                assert "### user:" in text and text.rstrip().endswith("### assistant:")


def test_prompts_come_from_train_fit_and_mix_tasks(corpus, tokenizer, tmp_path):
    out = tmp_path / "prompts.jsonl"
    summary = build_prompts(corpus=corpus, tokenizer=tokenizer, out=out, max_prompt_tokens=3000,
                            min_prompt_tokens=800, num_prompts=9)  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["prompts"] == len(rows) == 9
    assert {r["task"] for r in rows} == {"code", "summary", "qa"}
    assert len({r["id"] for r in rows}) == 9 and all(r["source"] == "train" for r in rows)
    for row in rows:
        rendered = render_prompt(tokenizer, f"{row['context']}\n\n{row['prompt']}")
        assert (
            800
            <= len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
            == row["prompt_tokens"]
            <= 3000
        )
        assert row["prompt"] and row["context"]


def test_long_documents_fit_and_feed_stage2(corpus, tokenizer, tmp_path):
    rows = [json.loads(line) for line in (corpus / "train.jsonl").read_text().splitlines()]
    rows += [{"text": module(f"short{i}", 6), "source": "train", "path": f"small/s{i}.py", "kind": "code",
              "licence": "MIT"} for i in range(12)]  # fmt: skip
    _write(corpus / "train.jsonl", rows)
    out = tmp_path / "long.jsonl"
    summary = build_long_documents(
        corpus=corpus, tokenizer=tokenizer, out=out, max_tokens=4096, min_tokens=1024
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["documents"] == len(rows) > 0
    for row in rows:
        assert 1024 <= row["tokens"] <= 4094
        assert row["tokens"] == len(tokenizer(row["text"], add_special_tokens=False)["input_ids"])
    assert any(len(r["paths"]) > 1 for r in rows)  # short files were joined
    manifest = prepare_stage2(sources=[str(out)], tokenizer=tokenizer, out=str(tmp_path / "s2"), seq_len=4096,
                              min_tokens=1024, progress=False)  # fmt: skip
    assert manifest.rows["kept"] == len(rows)


def _bundle_parts(corpus, tokenizer, tmp_path):
    """The bundle's inputs beside the corpus: long documents (long.jsonl), 3 prompts (p.jsonl), a 2K suite."""
    build_long_documents(corpus=corpus, tokenizer=tokenizer, out=tmp_path / "long.jsonl", max_tokens=4096,
                         min_tokens=1024)  # fmt: skip
    build_prompts(corpus=corpus, tokenizer=tokenizer, out=tmp_path / "p.jsonl", max_prompt_tokens=3000,
                  min_prompt_tokens=800, num_prompts=3)  # fmt: skip
    build_suite(corpus=corpus, tokenizer=tokenizer, out=tmp_path / "suite", buckets=[2048], per_bucket=1)


def test_bundle_holds_every_part_gzipped_and_stage1_reads_it(corpus, tokenizer, tmp_path):
    from data_prep.bundle import build_bundle
    from data_prep.stage1 import prepare_stage1

    _bundle_parts(corpus, tokenizer, tmp_path)
    manifest = build_bundle(corpus=corpus, tokenizer=tokenizer, out=tmp_path / "b", long_docs=tmp_path / "long.jsonl",
                            prompts=tmp_path / "p.jsonl", suite=tmp_path / "suite", stage1_tokens=20_000)  # fmt: skip
    stage1 = manifest["parts"]["corpus/train.jsonl.gz"]
    assert (
        20_000 <= stage1["tokens"] < 20_000 + 12_000 and stage1["rows"] < 12
    )  # stops once the budget is met
    assert manifest["parts"]["stage3_prompts.jsonl.gz"]["rows"] == 3
    assert {"suite/lcc_2k.jsonl", "suite/gov_report_2k.jsonl", "suite/qmsum_2k.jsonl"} <= set(
        manifest["bytes"]
    )
    assert manifest["corpus_tokens"]["train"] == sum(
        len(tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"])
        for line in (corpus / "train.jsonl").read_text().splitlines()
    )
    out = prepare_stage1(source=str(tmp_path / "b" / "corpus" / "train.jsonl.gz"), tokenizer=tokenizer,
                         out=str(tmp_path / "s1"), seq_len=512, progress=False)  # fmt: skip
    assert out.rows["kept"] == stage1["rows"]


def test_bundle_refuses_a_missing_or_empty_part_before_writing(corpus, tokenizer, tmp_path):
    from data_prep.bundle import build_bundle

    _bundle_parts(corpus, tokenizer, tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    parts = {
        "long_docs": tmp_path / "long.jsonl",
        "prompts": tmp_path / "p.jsonl",
        "suite": tmp_path / "suite",
    }
    for (
        change,
        message,
    ) in [  # each made a bundle with exit 0 (no suite at all, an empty part, 0 stage-1 rows)
        ({"suite": tmp_path / "no_suite"}, r"--suite .*no_suite' holds no eval suite"),
        ({"long_docs": tmp_path / "empty.jsonl"}, r"--long-docs .*empty.jsonl' holds no row"),
        ({"prompts": tmp_path / "missing.jsonl"}, r"--prompts .*missing.jsonl' does not exist"),
        ({"stage1_tokens": 0}, r"--stage1-tokens must be >= 1"),
    ]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            build_bundle(corpus=corpus, tokenizer=tokenizer, out=tmp_path / "b", **{**parts, **change})
        assert not (tmp_path / "b").exists()
    first = build_bundle(
        corpus=corpus, tokenizer=tokenizer, out=tmp_path / "b", stage1_tokens=20_000, **parts
    )
    again = build_bundle(
        corpus=corpus, tokenizer=tokenizer, out=tmp_path / "b", stage1_tokens=20_000, **parts
    )
    assert "manifest.json" not in again["bytes"]  # a rerun counted the first run's manifest
    assert again["bytes"].keys() == first["bytes"].keys()


def test_a_corpus_with_nothing_usable_is_an_error_and_writes_nothing(corpus, tokenizer, tmp_path):
    """Each tool used to write an empty output and exit 0; the failure came a step later, far from its cause."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.jsonl").write_text("")
    (empty / "heldout.jsonl").write_text("")
    out = tmp_path / "long.jsonl"
    with pytest.raises(ValueError, match=r"train.jsonl has no document of >= 64 tokens \(0 files read\)"):
        build_long_documents(corpus=empty, tokenizer=tokenizer, out=out, max_tokens=512, min_tokens=64)
    assert not out.exists()
    with pytest.raises(ValueError, match=r"no held-out document \(0 read\) fills any bucket \[2048\]"):
        build_suite(corpus=empty, tokenizer=tokenizer, out=tmp_path / "suite", buckets=[2048], gen_room=64)
    with pytest.raises(ValueError, match="at least one bucket"):
        build_suite(corpus=corpus, tokenizer=tokenizer, out=tmp_path / "suite", buckets=[], gen_room=64)
    assert not (tmp_path / "suite").exists()


def test_usage_errors_are_one_line(tmp_path, capsys):
    from data_prep import bundle, instruct_prompts, instruct_suite, long_documents

    for tool in (bundle, instruct_prompts, instruct_suite, long_documents):
        assert tool.main(["--out", str(tmp_path / "o")]) == 2  # was argparse's usage block
        err = capsys.readouterr().err
        assert err.startswith(f"error: python -m {tool.__name__}: the following arguments are required")
        assert err.count("\n") == 1
