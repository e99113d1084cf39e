"""benchmarks/round_log.py: round costs against the table and the families' balance against plain decoding, from
an eval results.json's and a decode_methods.json's round logs (hand-made, so every figure is known)."""

import json

import pytest


@pytest.fixture(scope="module")
def round_log(load_benchmark):
    return load_benchmark("round_log")


def _eval_results() -> dict:
    """One dataset: ar at 1.0 ms a round; longspec's call: 5 first rounds, then a plain run, a chain of one after
    it (the catch-up: 1.6 ms), the chain again (1.4 ms, one draft), a lookup that misses, and one stalled round."""
    trees = ["ar"] * 5 + ["ar", "ar", "1", "1", "lookup16", "ar"]
    ms = [1.0] * 5 + [1.0, 1.0, 1.6, 1.4, 1.3, 50.0]
    accepted = [0] * 5 + [0, 0, 0, 1, 0, 0]
    ar = {"round_ms": [1.2] * 5 + [1.0] * 20, "accepted": [0] * 25}
    return {
        "round_costs_s": {"1024:ar": 0.001, "1024:1": 0.0014, "1024:lookup16": 0.0013},
        "methods": {
            "longspec": {"qmsum": [{"prompt_len": 900, "round_trees": trees, "round_ms": ms, "accepted": accepted}]},
            "ar": {"qmsum": [ar]},
        },
    }  # fmt: skip


def test_an_eval_runs_round_log(round_log, tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_eval_results()))
    monkeypatch.setenv("OUT", str(tmp_path))
    report = round_log.main([str(path)])
    costs = {c["tree"]: c for c in report["costs"]}
    assert costs["1"]["median_ms"] == pytest.approx(1.5) and costs["1"]["table_ms"] == pytest.approx(1.4)
    assert costs["1"]["after_same_ms"] == pytest.approx(1.4) and costs["1"][
        "after_other_ms"
    ] == pytest.approx(1.6)
    balance = {(b["family"], b["phase"]): b for b in report["balance"]}
    # plain is 1.0 ms a round (ar's median past its first rounds): the chain after plain loses 0.6 ms, the chain in
    # its run gains 0.6 (2 tokens for 1.4 ms), the missed lookup loses 0.3; the 50-ms round is a stall
    assert balance[("drafter", "after a plain round")]["lost_ms"] == pytest.approx(0.6)
    assert balance[("drafter", "in a run")]["lost_ms"] == pytest.approx(-0.6)
    assert balance[("drafter", "in a run")]["drafts"] == 1
    assert balance[("lookup", "in a run")]["lost_ms"] == pytest.approx(0.3)
    assert balance[("plain", "first rounds")]["rounds"] == 5 and report["stalls"] == 1
    assert report["lost_ms"] == pytest.approx(0.3)
    assert json.loads((tmp_path / "round_log.json").read_text())["lost_ms"] == pytest.approx(0.3)


def test_decode_methods_rows_and_a_missing_plain_reference(round_log, tmp_path):
    rows = [
        {"method": "ar_graphs", "context": 4096, "rounds": [[[None, 0, 9.0]] * 8, [[None, 0, 1.1]] * 8]},
        {"method": "longspec_graphs", "context": 4096, "round_costs_s": {"4096:lookup8": 0.0013},
         "rounds": [[["lookup8", 3, 1.3]] * 6]},
    ]  # fmt: skip
    path = tmp_path / "decode_methods.json"
    path.write_text(json.dumps({"rows": rows}))
    report = round_log.main([str(path), "--json", str(tmp_path / "out.json")])
    # plain: ar_graphs' second repeat past its first rounds (1.1 ms); each lookup round emits 4 tokens for 1.3 ms
    assert report["lost_ms"] == pytest.approx(6 * (1.3 - 4 * 1.1))
    path.write_text(json.dumps({"rows": rows[1:]}))
    with pytest.raises(SystemExit, match="no plain rounds"):
        round_log.main([str(path)])


def test_results_recorded_before_round_logs_are_refused_clearly(round_log, tmp_path):
    results = _eval_results()
    for record in results["methods"]["longspec"]["qmsum"]:
        del record["round_trees"], record["round_ms"]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    with pytest.raises(SystemExit, match="no longspec call with a round log"):
        round_log.main([str(path)])
