"""data_prep.registry_corpus on archives made in the test: formats, junk filters, licence, stable split, no network."""

import hashlib
import json

import pytest
from registry_fixtures import make_deb, make_tar, make_zip, module, sdist_members, write_sources

from data_prep.archive_text import html_to_text, iter_archive
from data_prep.registry_corpus import RegistryCorpusConfig, build_registry_corpus, main, split_key
from data_prep.registry_sources import DEFAULT_SOURCES, RegistrySource, fetch
from data_prep.stdlib_corpus import split_of


def _rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture()
def corpus(tmp_path):
    sdist = make_tar(sdist_members(), top="fakepkg-1.0")
    wheel = make_zip({"wheelpkg/core.py": module("core", 20).encode(),
                      "wheelpkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: wheelpkg\nLicense: BSD-3-Clause\n"})  # fmt: skip
    deb = make_deb({
        "usr/share/doc/pydoc/html/guide.html": ("<html><body><div role='main'><h1>Guide</h1>"
                                                + "<p>Read the guide to learn the library well.</p>" * 20
                                                + "</div></body></html>").encode(),
        "usr/share/doc/pydoc-doc/copyright": b"Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
                                             b"\nFiles: *\nLicense: PSF-2.0\n",
        "usr/bin/tool.py": module("outside", 10).encode(),  # outside `include`: never read
    })  # fmt: skip
    spec = write_sources(tmp_path / "cache", {
        "fakepkg": ("pypi", sdist, "fakepkg-1.0.tar.gz", ""),
        "wheelpkg": ("pypi", wheel, "wheelpkg-1.0-py3-none-any.whl", ""),
        "pydoc": ("debian", deb, "pool/main/p/pydoc/pydoc_1.0_all.deb", "usr/share/doc/pydoc/html/"),
    })  # fmt: skip
    stdlib = tmp_path / "stdlib"
    (stdlib / "json").mkdir(parents=True)
    (stdlib / "json" / "encoder.py").write_text(module("enc", 15))
    (stdlib / "json" / "dup.py").write_text(module("m0", 12))  # same text as fakepkg's mod_00: a duplicate
    out = tmp_path / "out"
    cfg = RegistryCorpusConfig(out=out, sources=str(spec), cache=tmp_path / "cache", stdlib_root=stdlib,
                               heldout_frac=0.2, offline=True)  # fmt: skip
    return build_registry_corpus(cfg), out


def test_rows_kinds_and_licences(corpus):
    manifest, out = corpus
    rows = _rows(out / "train.jsonl") + _rows(out / "heldout.jsonl")
    by_key = {(r["source"], r["path"]): r for r in rows}
    assert set(rows[0]) == {"text", "source", "path", "kind", "licence"}
    assert by_key[("fakepkg", "src/fakepkg/mod_03.py")]["kind"] == "code"
    assert by_key[("fakepkg", "docs/guide.txt")]["kind"] == "prose"
    api = by_key[("fakepkg", "docs/api.html")]["text"]
    assert api.startswith("# API reference") and "adds two numbers & returns" in api
    assert "NAV" not in api and "var x" not in api  # sidebar and scripts are not text
    assert ("wheelpkg", "wheelpkg/core.py") in by_key
    assert by_key[("pydoc", "guide.html")]["kind"] == "prose"  # path relative to the include folder
    assert not any(r["path"].endswith("tool.py") for r in rows)
    assert {r["licence"] for r in rows if r["source"] != "python-stdlib"} == {"MIT"}
    assert {r["licence"] for r in rows if r["source"] == "python-stdlib"} == {"PSF-2.0"}
    sources = {s["name"]: s for s in manifest["sources"]}
    assert sources["fakepkg"]["licence_metadata"]["license_expression"] == "MIT"
    assert sources["fakepkg"]["licence_metadata"]["files"] == ["LICENSE"]
    assert sources["wheelpkg"]["licence_metadata"]["license"] == "BSD-3-Clause"
    assert sources["pydoc"]["licence_metadata"]["debian_copyright"] == ["PSF-2.0"]
    assert (
        sources["fakepkg"]["sha256"]
        == hashlib.sha256((out.parent / "cache" / "fakepkg-1.0.tar.gz").read_bytes()).hexdigest()
    )


def test_junk_is_filtered_with_reasons(corpus):
    manifest, out = corpus
    paths = {r["path"] for r in _rows(out / "train.jsonl") + _rows(out / "heldout.jsonl")}
    rejected = {s["name"]: s["rejected_by_reason"] for s in manifest["sources"]}
    assert rejected["fakepkg"] == {"binary": 1, "duplicate": 1, "empty": 1, "generated": 1, "licence_only": 1,
                                   "migration": 1, "minified": 1, "syntax_error": 1, "too_short": 1}  # fmt: skip
    assert rejected["python-stdlib"] == {"duplicate": 1}
    for junk in ("requirements.txt", "LICENSE", "docs/_static/theme.html", "PKG-INFO", "src/fakepkg/gen.py"):
        assert junk not in paths
    assert len(paths) == manifest["files"]["train"] + manifest["files"]["heldout"]


def test_split_is_a_stable_hash_of_source_and_path(corpus):
    manifest, out = corpus
    for split in ("train", "heldout"):
        for row in _rows(out / f"{split}.jsonl"):
            assert split_of(split_key(row["source"], row["path"]), 0.2) == split
    assert manifest["files"]["heldout"] > 0
    # The stdlib keeps data_prep.stdlib_corpus's key (its bare path), so both corpora hold out the same modules.
    assert split_key("python-stdlib", "json/encoder.py") == "json/encoder.py"
    assert split_key("django", "docs/index.txt") == "django:docs/index.txt"


def test_a_tampered_archive_is_refused(tmp_path):
    data = make_tar({"a.py": b"x = 1\n"}, top="p-1")
    source = RegistrySource(registry="pypi", name="p", version="1", filename="p-1.tar.gz",
                            sha256=hashlib.sha256(data).hexdigest(), licence="MIT")  # fmt: skip
    (tmp_path / "p-1.tar.gz").write_bytes(data + b"tampered")
    with pytest.raises(ValueError, match="does not match the pin"):
        fetch(source, tmp_path, offline=True)
    (tmp_path / "p-1.tar.gz").write_bytes(data)
    assert fetch(source, tmp_path, offline=True) == data


def test_cli_error_is_one_line(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "o"), "--sources", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert main(["--sources", "none"]) == 2  # a usage error: was argparse's usage block
    assert capsys.readouterr().err.startswith("error: python -m data_prep.registry_corpus: the following")
    assert (
        main(["--out", str(tmp_path / "o"), "--sources", "none", "--no-stdlib"]) == 2
    )  # was an empty corpus
    assert "nothing to build the corpus from" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_default_sources_are_pinned_and_permissive():
    names = [s.name for s in DEFAULT_SOURCES]
    assert len(names) == len(set(names))
    assert all(len(s.sha256) == 64 for s in DEFAULT_SOURCES)
    assert not any("GPL" in s.licence for s in DEFAULT_SOURCES)


def test_archive_paths_drop_the_versioned_top_folder_and_html_keeps_pre():
    members = dict(iter_archive("x-1.0.tar.gz", make_tar({"a/b.py": b"1", "c.md": b"2"}, top="x-1.0")))
    assert set(members) == {"a/b.py", "c.md"}
    text = html_to_text("<body><p>Use it:</p><pre>def f():\n    return 1\n</pre></body>")
    assert "def f():\n    return 1" in text
