import json

import pytest


@pytest.fixture(scope="module")
def batch_throughput(load_benchmark):
    return load_benchmark("batch_throughput")


def test_tiny_mode_writes_a_complete_table(batch_throughput, tmp_path, monkeypatch, capsys):
    """Batch 1 and 2 on CPU with the stand-in drafter accepting depth 1 always and depth 2 never: τ = 2 exactly
    (tree 2,2,2; 8 tokens = the prefill's + 7 in rounds of 2, the last round's extra token truncated)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    batch_throughput.main(["--tiny", "--accept-profile", "1,0"])
    result = json.loads((tmp_path / "batch_throughput.json").read_text())
    assert result["accept_profile"] == [1.0, 0.0] and result["expected_tau"] == 2.0
    assert result["tree_widths"] == [2, 2, 2] and result["vanilla_fa"] == "per sequence, batch 1"
    assert [(r["context"], r["batch"]) for r in result["rows"]] == [(40, 1), (40, 2)]
    for row in result["rows"]:
        for key in ("ar_tok_s", "longspec_tok_s", "vanilla_fa_tok_s"):
            assert row[key] > 0, key
        assert row["speedup"] == pytest.approx(row["longspec_tok_s"] / row["ar_tok_s"])
        # the script's own check: every sequence's longspec output == its ar output
        assert row["lossless"] == [True] * row["batch"] and row["longspec_matches_ar"]
        assert row["tau"] == 2.0 and row["tokens_per_row"] == [8] * row["batch"]
    assert result["all_lossless"]
    out = capsys.readouterr().out
    assert "| context | batch | AR tok/s | LongSpec tok/s | LongSpec/AR |" in out


def test_expected_tau(batch_throughput):
    assert batch_throughput.expected_tau([1.0, 0.5], 3) == 2.5  # 1 + 1 + 0.5; depth 3 accepts nothing
    assert batch_throughput.expected_tau([0.8] * 10, 2) == pytest.approx(1 + 0.8 + 0.64)
