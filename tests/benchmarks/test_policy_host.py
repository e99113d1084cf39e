"""benchmarks/policy_host.py at a few rounds: it times every mix, each mix runs what it says, and the replay it
times makes the recording's choices."""

import json


def test_policy_host_times_every_mix(load_benchmark, tmp_path, monkeypatch):
    policy_host = load_benchmark("policy_host")
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = policy_host.main(["--rounds", "800", "--repeats", "1"])  # the mix: 250 rounds a text
    assert [r["mix"] for r in rows] == ["plain", "drafter", "lookup", "mix"]
    assert all(r["us_per_round"] > 0 and r["rounds"] == 800 for r in rows)
    kinds = {r["mix"]: r["rounds_by_kind"] for r in rows}
    assert (
        kinds["plain"]["plain"] > 700
        and kinds["drafter"]["drafter"] > 700
        and kinds["lookup"]["lookup"] > 700
    )
    assert len(kinds["mix"]) == 3  # the mix runs all three
    written = json.loads((tmp_path / "policy_host.json").read_text())
    assert written["rows"] == rows


def test_a_replay_that_chooses_otherwise_is_refused(load_benchmark):
    policy_host = load_benchmark("policy_host")
    calls, _ = policy_host.record("drafter", 50, seed=0)
    choose = next(k for k, call in enumerate(calls) if call[0].__name__ == "choose")
    fn, args, kwargs, _ = calls[choose]
    calls[choose] = (fn, args, kwargs, "not a candidate")
    try:
        policy_host.replay(calls, seed=0)
    except RuntimeError:
        return
    raise AssertionError("the replay accepted other choices than the recording's")
