"""data_prep.stdlib_corpus: deterministic path-hash split, reject counting, LCC rows (issue 5)."""

import json
import shutil

import pytest

from data_prep.stdlib_corpus import CorpusConfig, build_corpus, lcc_row, main, path_fraction, split_of
from longspec.cli import run_cli


def _long_module(n: int) -> str:
    """A valid module of ~n functions, long enough to make an LCC row."""
    body = []
    for i in range(n):
        body.append(f"def func_{i}(x, y={i}):\n    '''Return a mix of x and {i}.'''\n\n    z = x * y + {i}\n")
        body.append(f"    return z - func_{i - 1}(x) if {i} else z\n\n" if i else "    return z\n\n")
    return "".join(body)


@pytest.fixture()
def fake_stdlib(tmp_path):
    root = tmp_path / "lib" / "python3.x"
    (root / "pkg").mkdir(parents=True)
    for i in range(40):
        (root / "pkg" / f"mod_{i:02d}.py").write_text(_long_module(60 + i), encoding="utf-8")
    (root / "small.py").write_text("import os\n\nPATH = os.sep\n", encoding="utf-8")
    (root / "latin1.py").write_bytes("# -*- coding: latin-1 -*-\nname = 'caf\xe9'\n".encode("latin-1"))
    (root / "empty.py").write_text("\n\n", encoding="utf-8")
    (root / "py2.py").write_text("print 'hello'\n", encoding="utf-8")
    (root / "nul.py").write_bytes(b"x = 1\x00\n")
    (root / "bom.py").write_bytes("\ufeffvalue = 1\n".encode())
    (root / "test" / "tokenizedata").mkdir(parents=True)
    (root / "test" / "tokenizedata" / "fixture.py").write_text("x = 1\n", encoding="utf-8")
    (root / "site-packages" / "thirdparty").mkdir(parents=True)
    (root / "site-packages" / "thirdparty" / "mod.py").write_text("x = 1\n", encoding="utf-8")
    (root / "notes.txt").write_text("not python\n", encoding="utf-8")
    return root


def _read(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_rejects_are_counted_with_reasons(fake_stdlib, tmp_path):
    manifest = build_corpus(CorpusConfig(out=tmp_path / "out", root=fake_stdlib), progress=False)
    assert manifest["rejected_by_reason"] == {
        "binary": 1, "empty": 1, "not_utf8": 1, "syntax_error": 1, "test_data_dir": 1
    }  # fmt: skip
    assert manifest["rejected_paths"]["latin1.py"] == "not_utf8"
    # site-packages is never walked and .txt never read: 40 modules + small + bom + the 5 rejects.
    assert manifest["files_read"] == 40 + 2 + 5
    assert manifest["files_kept"] == 42 == manifest["files"]["train"] + manifest["files"]["heldout"]
    rows = _read(tmp_path / "out" / "train.jsonl") + _read(tmp_path / "out" / "heldout.jsonl")
    assert {r["path"] for r in rows}.isdisjoint(manifest["rejected_paths"])
    assert not any("site-packages" in r["path"] for r in rows)
    bom = next(r for r in rows if r["path"] == "bom.py")
    assert bom["text"] == "value = 1\n"  # the BOM is dropped, the code kept
    assert manifest["bytes"]["train"] == sum(
        len(r["text"].encode()) for r in _read(tmp_path / "out" / "train.jsonl")
    )


def test_split_is_deterministic_and_independent_of_root(fake_stdlib, tmp_path):
    elsewhere = tmp_path / "other_machine" / "lib"
    shutil.copytree(fake_stdlib, elsewhere)
    cfg_a = CorpusConfig(out=tmp_path / "a", root=fake_stdlib, heldout_frac=0.3)
    cfg_b = CorpusConfig(out=tmp_path / "b", root=elsewhere, heldout_frac=0.3)
    build_corpus(cfg_a, progress=False)
    build_corpus(cfg_b, progress=False)
    for name in ("train.jsonl", "heldout.jsonl", "heldout_lcc.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    heldout = _read(tmp_path / "a" / "heldout.jsonl")
    train = _read(tmp_path / "a" / "train.jsonl")
    assert heldout and train
    assert all(split_of(r["path"], 0.3) == "heldout" and path_fraction(r["path"]) < 0.3 for r in heldout)
    assert all(split_of(r["path"], 0.3) == "train" for r in train)


def test_lcc_rows_follow_the_longbench_schema(fake_stdlib, tmp_path):
    out = tmp_path / "out"
    manifest = build_corpus(
        CorpusConfig(out=out, root=fake_stdlib, heldout_frac=0.5, lcc_min_chars=2000), progress=False
    )
    rows = _read(out / "heldout_lcc.jsonl")
    assert len(rows) == manifest["lcc_rows"] > 0
    sources = {r["path"]: r["text"] for r in _read(out / "heldout.jsonl")}
    for row in rows:
        assert set(row) >= {
            "_id",
            "input",
            "context",
            "answers",
            "length",
            "all_classes",
            "language",
            "dataset",
        }
        assert (row["input"], row["all_classes"], row["language"], row["dataset"]) == (
            "",
            None,
            "python",
            "lcc",
        )
        text = sources[row["path"]]
        assert text.startswith(row["context"]) and row["context"].endswith("\n")  # cut at a line boundary
        rest = text[len(row["context"]) :]
        next_code_line = next(line for line in rest.splitlines() if line.strip())
        assert row["answers"] == [next_code_line]
        assert row["length"] == len(row["context"].split())


def test_lcc_context_respects_the_size_cap():
    text = _long_module(400)
    cfg = CorpusConfig(out=None, lcc_min_chars=1000, lcc_max_context_chars=5000)
    row = lcc_row("pkg/long.py", text, cfg)
    assert row is not None and len(row["context"]) <= 5000 and text.startswith(row["context"])
    assert lcc_row("pkg/short.py", "x = 1\n" * 10, cfg) is None


def test_user_errors(tmp_path):
    with pytest.raises(ValueError, match="heldout_frac"):
        CorpusConfig(out=tmp_path, heldout_frac=1.5)
    with pytest.raises(FileNotFoundError, match="--root"):
        build_corpus(CorpusConfig(out=tmp_path / "o", root=tmp_path / "missing"), progress=False)
    (tmp_path / "empty").mkdir()  # an empty corpus was written with exit 0 (the first prep failed on it)
    with pytest.raises(ValueError, match="holds no .py file"):
        build_corpus(CorpusConfig(out=tmp_path / "o", root=tmp_path / "empty"), progress=False)
    assert not (tmp_path / "o").exists()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.py").write_text("def (\n")
    with pytest.raises(ValueError, match=r"was rejected \(syntax_error: 1\); the corpus would be empty"):
        build_corpus(CorpusConfig(out=tmp_path / "o", root=tmp_path / "bad"), progress=False)
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_usage_error_is_one_line(capsys):
    assert run_cli(main, ["--root", "x"]) == 2  # was argparse's usage block
    assert capsys.readouterr().err == (
        "error: python -m data_prep.stdlib_corpus: the following arguments are required: --out (see --help)\n"
    )


def test_cli_writes_manifest(fake_stdlib, tmp_path, capsys):
    main(["--out", str(tmp_path / "cli"), "--root", str(fake_stdlib), "--heldout-frac", "0.2"])
    manifest = json.loads((tmp_path / "cli" / "manifest.json").read_text())
    assert manifest["heldout_frac"] == 0.2 and manifest["files_rejected"] == 5
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["files_kept"] == 42
