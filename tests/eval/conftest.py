"""Fixtures of the evaluation tests: a saved tiny target (+ byte tokenizer) and a LongBench-schema JSONL."""

import json

import pytest

from longspec.testing import save_tiny_target


@pytest.fixture(autouse=True, scope="session")
def _one_thread(one_thread):
    """Tiny shapes only: one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    return save_tiny_target("llama", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture
def eval_overrides(tiny_target_dir, longbench_jsonl):
    """The overrides of a quick run on the tiny target (random drafter, 10 new tokens), on `data` or the JSONL
    below; `out`: output_dir (None: not set)."""

    def overrides(out, *extra, data=None) -> list[str]:
        return [
            "target=tiny_llama",
            f"target.path={tiny_target_dir}",
            f"data.path={data or longbench_jsonl}",
            "data.min_prompt_tokens=0",
            "drafter.init=random",
            "drafter.window=8",
            "max_new_tokens=10",
            *([f"output_dir={out}"] if out is not None else []),
            *extra,
        ]

    return overrides


@pytest.fixture
def longbench_jsonl(tmp_path):
    """Two good rows (code with braces, a qmsum-style query) and three malformed ones."""
    path = tmp_path / "rows.jsonl"
    rows = [
        {
            "_id": "code-0",
            "context": "def f(x):\n    return {x: 1}\n" * 3,
            "input": "",
            "answers": ["f"],
            "dataset": "lcc",
        },
        {
            "_id": "meet-1",
            "context": "A: hello. B: we ship on Monday. " * 3,
            "input": "When do we ship?",
            "answers": ["Monday"],
            "dataset": "qmsum",
        },
    ]
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.write("{not json\n")
        f.write(json.dumps({"_id": "no-context", "input": "q"}) + "\n")
        f.write("\n")  # blank lines are not rows
        f.write(json.dumps(["a", "list"]) + "\n")
    return str(path)
