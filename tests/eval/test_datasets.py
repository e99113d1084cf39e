import json

import pytest

from longspec.eval.datasets import load_samples, read_jsonl
from longspec.eval.prompts import LONGBENCH_TEMPLATES, longbench_prompt, math_messages
from longspec.testing import build_byte_tokenizer


def test_longbench_templates_are_the_five_long_output_tasks():
    assert set(LONGBENCH_TEMPLATES) == {"gov_report", "qmsum", "multi_news", "lcc", "repobench-p"}
    prompt = longbench_prompt("repobench-p", "x = {'a': 1}\n", "y = ")
    assert prompt == "Please complete the code given below. \nx = {'a': 1}\ny = Next line of code:\n"
    assert longbench_prompt("narrativeqa", "C", "Q") == "C\n\nQ"  # not a long-output task: generic
    assert longbench_prompt("lcc_e", "C", "Q") == longbench_prompt("lcc", "C", "Q")  # LongBench-E rows
    assert "\\boxed{}" in math_messages("1+1?")[0]["content"]


def test_read_jsonl_counts_malformed_rows(longbench_jsonl):
    rows, malformed = read_jsonl(longbench_jsonl)
    assert [line for line, _ in rows] == [1, 2]
    assert [line for line, _ in malformed] == [3, 4, 6]
    assert "context" in malformed[1][1] and "list" in malformed[2][1]
    with pytest.raises(FileNotFoundError):
        read_jsonl(longbench_jsonl + ".missing")


def test_length_filter_is_the_papers(longbench_jsonl):
    tokenizer = build_byte_tokenizer()
    everything, _ = load_samples(
        longbench_jsonl, tokenizer, context_len=4096, min_prompt_tokens=0, context_margin=0
    )
    lengths = sorted(s.prompt_len for s in everything)
    # keep min < len <= context_len - margin: set the bounds exactly at the two prompt lengths
    kept, report = load_samples(
        longbench_jsonl,
        tokenizer,
        context_len=lengths[1] + 10,
        min_prompt_tokens=lengths[0],
        context_margin=10,
    )
    assert [s.prompt_len for s in kept] == [lengths[1]]
    assert report.num_filtered == 1 and report.num_kept == 1 and len(report.malformed) == 3
    # byte tokenizer: BOS + the bytes of the template-formatted prompt
    code = next(s for s in everything if s.id == "code-0")
    assert code.prompt_ids[0] == 256 and bytes(code.prompt_ids[1:]).decode().startswith(
        "Please complete the code"
    )


def test_math_prompt_uses_the_chat_template():
    from longspec.eval.datasets import _encode_chat

    ids = _encode_chat(build_byte_tokenizer(), math_messages("What is 2+2?"))
    text = bytes(i for i in ids if i < 256).decode()
    assert ids[0] == 256  # the template's bos
    assert text.startswith("### user:\nWhat is 2+2?\nPlease reason step by step")
    assert text.endswith("### assistant:\n")  # generation prompt


def test_longbench_falls_back_to_the_repository_zip(tmp_path, monkeypatch, longbench_jsonl):
    """datasets >= 4 refuses LongBench's loading script: its data.zip (data/<task>.jsonl) is read instead."""
    import zipfile

    import datasets
    import huggingface_hub

    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.write(longbench_jsonl, "data/lcc.jsonl")

    def no_scripts(*args, **kwargs):
        raise RuntimeError("Dataset scripts are no longer supported")

    monkeypatch.setattr(datasets, "load_dataset", no_scripts)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name, repo_type: str(archive))
    samples, report = load_samples(
        "lcc", build_byte_tokenizer(), context_len=4096, min_prompt_tokens=0, context_margin=0
    )
    assert [s.id for s in samples] == ["code-0", "meet-1"] and len(report.malformed) == 3
    assert all(s.dataset == "lcc" for s in samples)
    text = bytes(samples[1].prompt_ids[1:]).decode()  # every row gets the task's template, not the row's
    assert text.startswith("Please complete the code given below.") and text.endswith("Next line of code:\n")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_scripts)
    with pytest.raises(ValueError, match="data.path=data/lcc.jsonl"):
        load_samples("lcc", build_byte_tokenizer(), context_len=4096, min_prompt_tokens=0, context_margin=0)


def test_aime24_keeps_ids_60_to_89_with_the_chat_template(monkeypatch):
    import datasets

    rows = [{"id": i, "problem": f"Problem {i}?", "answer": "1"} for i in range(0, 90, 10)]
    monkeypatch.setattr(datasets, "load_dataset", lambda hub_id, split: rows)
    samples, report = load_samples(
        "aime24", build_byte_tokenizer(), context_len=4096, min_prompt_tokens=None, context_margin=0
    )
    assert [s.id for s in samples] == ["60", "70", "80"] and report.num_rows == 3
    assert bytes(i for i in samples[0].prompt_ids if i < 256).decode().startswith("### user:\nProblem 60?")


def test_fields_of_the_wrong_type_make_a_row_malformed(tmp_path):
    """`dataset` picks the template and `chat` the chat wrapping: a number there crashed the run, and the
    string "false" (truthy) chat-wrapped the row. Both are the row's problem, counted and skipped."""
    path = tmp_path / "rows.jsonl"
    rows = [
        {"_id": "ok", "context": "c", "input": "", "dataset": None, "chat": False},
        {"_id": "num", "context": "c", "input": "", "dataset": 42},
        {"_id": "str-chat", "context": "c", "input": "", "chat": "false"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept, malformed = read_jsonl(str(path))
    assert [row["_id"] for _, row in kept] == ["ok"]
    assert [(line, why.split(" (")[0]) for line, why in malformed] == [
        (2, "wrong type of field(s): dataset"),
        (3, "wrong type of field(s): chat"),
    ]
    samples, report = load_samples(
        str(path), build_byte_tokenizer(), context_len=4096, min_prompt_tokens=0, context_margin=0
    )
    assert [s.id for s in samples] == ["ok"] and len(report.malformed) == 2


def test_repeated_ids_are_made_unique(tmp_path):
    """The report matches outputs by sample id: a repeated `_id`, or an `_id` equal to the line number that
    names a row without one, is renamed ID#k, every sample keeps its own id."""
    path = tmp_path / "rows.jsonl"
    rows = [
        {"_id": "a", "context": "one", "input": ""},
        {"context": "two", "input": ""},  # id "2", its line
        {"_id": "a", "context": "three", "input": ""},
        {"_id": 2, "context": "four", "input": ""},
        {"_id": "a", "context": "five", "input": ""},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples, _ = load_samples(
        str(path), build_byte_tokenizer(), context_len=4096, min_prompt_tokens=0, context_margin=0
    )
    assert [s.id for s in samples] == ["a", "2", "a#2", "2#2", "a#3"]
