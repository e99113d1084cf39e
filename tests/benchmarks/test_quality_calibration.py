import inspect
import json

import pytest

from longspec.pipeline.presets import CODE_TARGET


@pytest.fixture(scope="module")
def calibration(load_benchmark):
    return load_benchmark("quality_calibration")


def test_scores_corpus_windows_and_references(calibration, tmp_path, monkeypatch):
    """Real code is kept and a loop is flagged, both in the corpus windows and in an eval's references; installed
    packages and test suites under the corpus directory are not the corpus."""
    corpus = tmp_path / "lib"
    (corpus / "site-packages").mkdir(parents=True)
    (corpus / "tests").mkdir()
    real = inspect.getsource(json.decoder)  # real code that no one here wrote
    loop = "x = 1\n" * 400
    (corpus / "decoder.py").write_text(real)
    (corpus / "loop.py").write_text(loop)
    (corpus / "site-packages" / "other.py").write_text(real)
    (corpus / "tests" / "data.txt").write_text(loop)
    tokenizer = calibration.load_tokenizer(str(CODE_TARGET))
    ids = {
        name: tokenizer(text, add_special_tokens=False)["input_ids"][:64]
        for name, text in (("real", real), ("loop", loop))
    }
    results = tmp_path / "results.json"
    results.write_text(
        json.dumps(
            {
                "methods": {
                    "ar": {
                        "lcc": [
                            {"id": "a", "output_ids": ids["real"]},
                            {"id": "b", "output_ids": ids["loop"]},
                        ]
                    }
                }
            }
        )
    )
    monkeypatch.setenv("OUT", str(tmp_path))
    out = calibration.main(
        [
            "--tokenizer",
            str(CODE_TARGET),
            "--corpus",
            str(corpus),
            "--window",
            "64",
            "--results",
            str(results),
        ]
    )
    windows = {row["file"].rsplit("/", 1)[-1]: row for row in out["corpus_windows"]}
    assert set(windows) == {"decoder.py", "loop.py"}
    assert not windows["decoder.py"]["degenerate"] and windows["loop.py"]["degenerate"]
    assert out["summary"]["windows"] == 2 and out["summary"]["flagged"] == 1
    assert [(row["id"], row["degenerate"]) for row in out["references"]] == [("a", False), ("b", True)]
    assert json.loads((tmp_path / "quality_calibration.json").read_text())["summary"] == out["summary"]
