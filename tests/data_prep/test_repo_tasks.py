"""Repository-level completion rows (data_prep.repo_tasks) and the split by package (data_prep.package_split): imports
resolve to the package's own files, the rows fit their buckets and read back as LongBench repobench-p rows, and no
package of the evaluation suite reaches any training stage's data (issue 45). Byte tokenizer: one token a byte."""

import gzip
import json

import pytest
from registry_fixtures import module, prose

from data_prep.bundle import build_bundle
from data_prep.instruct_prompts import build_prompts
from data_prep.instruct_suite import SUITE_TASKS, build_suite
from data_prep.long_documents import build_long_documents
from data_prep.package_split import main as split_main
from data_prep.package_split import split_by_package
from data_prep.repo_tasks import PackageIndex, cut_repo_task, imports_of, module_name
from longspec.eval.datasets import encode_row, load_samples
from tests.faults.fault_helpers import assert_one_line_error, run_in_process

TASKS = ("lcc", "repobench-p", "gov_report", "qmsum")


def _code(name: str, imports: list[str], uses: list[str], n: int) -> str:
    """A module importing `imports` whose functions call the imported names `uses`."""
    head = "".join(f"{line}\n" for line in imports)
    body = [f'"""Module {name}."""\n\n{head}\n\n']
    for i in range(n):
        call = f"{uses[i % len(uses)]}(x, {i})" if uses else f"x + {i}"
        body.append(f"def {name}_step_{i}(x):\n    \"\"\"Step {i} of {name}.\"\"\"\n    value = {call}\n"
                    f"    return value * {i + 1}\n\n\n")  # fmt: skip
    return "".join(body)


def _package(pkg: str, n: int = 40) -> list[dict]:
    """One package's rows: a util module, models, a core importing both (relatively and absolutely), a sub-package
    module importing two levels up, and its docs."""
    files = {
        f"src/{pkg}/__init__.py": _code(f"{pkg}_init", [], [], 4),
        f"src/{pkg}/util.py": _code("util", ["import os"], [], n),
        f"src/{pkg}/models.py": _code("models", [], [], n),
        f"src/{pkg}/core.py": _code(
            "core",
            ["import json", "from .util import util_step_1", f"from {pkg} import models"],
            ["util_step_1", "models.models_step_2"],
            n,
        ),  # fmt: skip
        f"src/{pkg}/sub/deep.py": _code(
            "deep", ["from ..core import core_step_3", f"import {pkg}.util"], ["core_step_3"], n
        ),  # fmt: skip
    }
    rows = [
        {"text": text, "source": pkg, "path": path, "kind": "code", "licence": "MIT"}
        for path, text in files.items()
    ]
    for i in range(6):
        rows.append({"text": module(f"{pkg}_extra{i}", 30 + 5 * i), "source": pkg, "path": f"src/{pkg}/extra{i}.py",
                     "kind": "code", "licence": "MIT"})  # fmt: skip
        rows.append({"text": prose(f"{pkg} guide {i}", 14 + 3 * i), "source": pkg, "path": f"docs/g{i}.rst",
                     "kind": "prose", "licence": "MIT"})  # fmt: skip
    return rows


@pytest.fixture()
def corpus(tmp_path):
    """A registry-style corpus of four packages, each split by file between train and heldout."""
    out = tmp_path / "corpus"
    out.mkdir()
    rows = [row for pkg in ("alpha", "beta", "gamma", "delta") for row in _package(pkg)]
    for split, part in (("train", rows[0::2]), ("heldout", rows[1::2])):
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
    sources = [{"name": pkg, "files": {}, "bytes": {}, "kinds": {}, "rejected_by_reason": {}}
               for pkg in ("alpha", "beta", "gamma", "delta")]  # fmt: skip
    (out / "manifest.json").write_text(
        json.dumps({"sources": sources, "split_rule": "by file"}), encoding="utf-8"
    )
    return out


def test_imports_resolve_to_the_package_files_in_statement_order():
    rows = _package("alpha")
    index = PackageIndex(rows)
    by_path = {r["path"]: r for r in rows}
    assert module_name("src/alpha/sub/__init__.py") == "src.alpha.sub" and module_name("docs/a.rst") is None
    found, bound = imports_of(by_path["src/alpha/core.py"], index)
    assert [f["path"] for f in found] == [
        "src/alpha/util.py",
        "src/alpha/models.py",
    ]  # os / json: not the package's
    assert bound == {"util_step_1", "models"}
    found, _ = imports_of(by_path["src/alpha/sub/deep.py"], index)  # `from ..core`, `import alpha.util`
    assert [f["path"] for f in found] == ["src/alpha/core.py", "src/alpha/util.py"]


def test_a_repository_row_puts_the_imported_files_first_and_cuts_before_a_line_using_them():
    rows = _package("alpha")
    core = next(r for r in rows if r["path"] == "src/alpha/core.py")

    def count(context, instruction):
        return len(context) + len(instruction)

    cut = cut_repo_task(core, PackageIndex(rows), count, 14000)
    assert cut["context"].startswith("# Path: src/alpha/util.py\n")
    assert cut["context_paths"][:2] == ["src/alpha/util.py", "src/alpha/models.py"]
    assert "src/alpha/core.py" not in cut["context_paths"]
    assert 0.95 * 14000 <= count(cut["context"], cut["instruction"]) <= 14000
    assert cut["instruction"].startswith("# Path: src/alpha/core.py\n") and cut["instruction"].endswith("\n")
    in_file = cut["instruction"][len("# Path: src/alpha/core.py\n") :]
    assert core["text"].startswith(in_file)
    assert cut["answer"] == next(ln for ln in core["text"][len(in_file) :].splitlines() if ln.strip())
    assert "util_step_1" in cut["answer"] or "models" in cut["answer"]
    # A file that imports nothing of its package is no repository task.
    util = next(r for r in rows if r["path"] == "src/alpha/util.py")
    assert cut_repo_task(util, PackageIndex(rows), count, 14000) is None


def test_no_package_of_the_suite_reaches_a_training_stage(corpus, tokenizer, tmp_path):
    split = tmp_path / "split"
    manifest = split_by_package(corpus=corpus, heldout_packages=["alpha", "beta"], out=split)
    assert manifest["heldout_packages"] == ["alpha", "beta"]
    assert sum(manifest["files"].values()) == 4 * len(_package("x"))  # every row kept, in one split
    suite = tmp_path / "suite"
    built = build_suite(corpus=split, tokenizer=tokenizer, out=suite, buckets=[2048, 4096], per_bucket=2,
                        gen_room=512, tasks=TASKS)  # fmt: skip
    assert not built["shortfalls"], built["shortfalls"]
    suite_packages = set()
    for stem in TASKS:
        dataset = SUITE_TASKS[stem][0]
        for bucket in (2048, 4096):
            path = suite / f"{stem}_{bucket // 1024}k.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            assert len(rows) == 2
            for row in rows:
                suite_packages.add(row["source"])
                assert row["dataset"] == dataset and row["chat"] is (dataset in ("doc_summary", "doc_qa"))
                assert row["prompt_tokens"] == len(encode_row(tokenizer, row, dataset))
                assert 0.8 * (bucket - 512) <= row["prompt_tokens"] <= bucket - 512
                if dataset == "repobench-p":
                    assert all(p.startswith(f"src/{row['source']}/") for p in row["context_paths"])
                    assert row["answers"] and row["input"].startswith(f"# Path: {row['path']}\n")
            samples, report = load_samples(str(path), tokenizer, context_len=bucket, min_prompt_tokens=0,
                                           context_margin=512)  # fmt: skip
            assert report.num_kept == 2 and not report.malformed
            if dataset == "repobench-p":  # LongBench's repobench-p template, raw text
                text = tokenizer.decode(samples[0].prompt_ids)
                assert text.startswith("<|bos|>Please complete the code given below. \n# Path: ")
                assert text.endswith("Next line of code:\n")
    assert suite_packages == {"alpha", "beta"}
    # Every training input: stage-2 long documents, stage-3 prompts, the bundle's stage-1 text.
    build_long_documents(corpus=split, tokenizer=tokenizer, out=tmp_path / "long.jsonl", max_tokens=4096,
                         min_tokens=1024)  # fmt: skip
    build_prompts(corpus=split, tokenizer=tokenizer, out=tmp_path / "prompts.jsonl", max_prompt_tokens=3000,
                  min_prompt_tokens=1000, num_prompts=6)  # fmt: skip
    bundle = tmp_path / "bundle"
    build_bundle(corpus=split, tokenizer=tokenizer, out=bundle, long_docs=tmp_path / "long.jsonl",
                 prompts=tmp_path / "prompts.jsonl", suite=suite, stage1_tokens=10**9, gzip_suite=True)  # fmt: skip
    with gzip.open(
        bundle / "suite" / "repobench-p_4k.jsonl.gz", "rt"
    ) as f:  # the suite gzip'd as it was written
        assert f.read() == (suite / "repobench-p_4k.jsonl").read_text()
    trained = set()
    for path in (tmp_path / "long.jsonl", tmp_path / "prompts.jsonl"):
        trained |= {json.loads(line)["source"] for line in path.read_text().splitlines()}
    with gzip.open(bundle / "corpus" / "train.jsonl.gz", "rt") as f:
        stage1 = {json.loads(line)["source"] for line in f}
    assert stage1 == {"gamma", "delta"} and trained <= {"gamma", "delta"}


def test_package_split_refuses_unknown_or_all_packages(corpus, tmp_path, capsys):
    out = tmp_path / "split"
    status, err = run_in_process(split_main, ["--corpus", str(corpus), "--heldout-packages", "alpha,omega",
                                              "--out", str(out)], capsys)  # fmt: skip
    assert status == 2
    assert_one_line_error(err, r"omega: not in the corpus; choose from alpha, beta, gamma, delta")
    status, err = run_in_process(split_main, ["--corpus", str(corpus), "--heldout-packages",
                                              "alpha,beta,gamma,delta", "--out", str(out)], capsys)  # fmt: skip
    assert status == 2 and "nothing would train" in err
    assert not out.exists()
