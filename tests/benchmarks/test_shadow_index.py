"""benchmarks/shadow_index.py at tiny sizes: it times the shadow tree="auto" runs, and its prompts give the draft
something to find."""

import json


def test_shadow_index_times_the_index_and_the_rounds(load_benchmark, tmp_path, monkeypatch):
    shadow_index = load_benchmark("shadow_index")
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = shadow_index.main(["--lengths", "300", "2000", "--rounds", "50", "--repeats", "1"])
    assert [r["prompt_tokens"] for r in rows] == [300, 2000]
    assert all(r["build_ms"] > 0 and r["round_us"] > 0 for r in rows)
    written = json.loads((tmp_path / "shadow_index.json").read_text())
    assert written["rows"] == rows


def test_the_prompt_repeats_its_tail_in_its_middle(load_benchmark):
    shadow_index = load_benchmark("shadow_index")
    tokens = shadow_index.prompt(1000, 49152)
    assert len(tokens) == 1000 and tokens[500:564] == tokens[-64:]
