"""benchmarks/compare_runs.py: two hand-made runs whose figures are known, a sample one run's guard sets apart
left out of both, and the bad-argument paths."""

import json

import pytest


@pytest.fixture(scope="module")
def compare_runs(load_benchmark):
    return load_benchmark("compare_runs")


TEXT = list(range(40))  # 40 distinct tokens: kept by the quality guard
LOOP = [7, 8] * 20  # a two-token loop: set apart


def _record(sample: str, output: list[int], rounds: int, accepted: int, decode_s: float) -> dict:
    per_round = [accepted // rounds] * rounds
    per_round[0] += accepted - sum(per_round)
    return {
        "id": sample, "prompt_len": 100, "output_ids": output, "num_new_tokens": len(output) + 1,
        "rounds": rounds, "accepted": per_round, "decode_s": decode_s,
        "draft_s": 0.0, "verify_s": decode_s, "overhead_s": 0.0,
    }  # fmt: skip


def _write_run(root, name: str, b_output: list[int], tau_rounds: tuple[int, int]) -> None:
    """eval_t0 of one run: datasets d1 (sample a) and d2 (sample b); ar decodes 40 tokens in 0.4 s per sample,
    longspec in `rounds` rounds accepting `accepted` drafts over 0.2 s."""
    rounds, accepted = tau_rounds
    methods = {
        "longspec": {
            "d1": [_record("a", TEXT, rounds, accepted, 0.2)],
            "d2": [_record("b", b_output, rounds, accepted, 0.2)],
        },
        "ar": {
            "d1": [_record("a", TEXT, 40, 0, 0.4)],
            "d2": [_record("b", b_output, 40, 0, 0.4)],
        },
    }
    folder = root / name / "eval_t0"
    folder.mkdir(parents=True)
    results = {"config": {"generation": {"temperature": 0.0}}, "methods": methods}
    (folder / "results.json").write_text(json.dumps(results))


def test_runs_are_compared_on_the_samples_every_run_keeps(compare_runs, tmp_path, capsys):
    _write_run(tmp_path, "one", TEXT, (20, 20))  # τ (20 + 20) / 20 = 2.0
    _write_run(tmp_path, "two", LOOP, (10, 30))  # τ 4.0; its sample b loops: b is left out of both runs
    rows = compare_runs.compare({"A": tmp_path / "one", "B": tmp_path / "two"}, ["t0", "t_missing"])
    assert [row["eval"] for row in rows] == ["t0"]  # an evaluation missing from a run is skipped
    (row,) = rows
    assert row["samples"] == 1
    assert row["runs"]["A"]["tau"] == pytest.approx(2.0)
    assert row["runs"]["B"]["tau"] == pytest.approx(4.0)
    assert row["runs"]["A"]["speedup"] == pytest.approx(2.0)  # 0.2 s against ar's 0.4 s for the same tokens
    table = compare_runs.main([f"A={tmp_path / 'one'}", f"B={tmp_path / 'two'}", "--evals", "t0"])
    assert "| t0 (1) | 2.00 | 4.00 | 2.00x | 2.00x |" in table
    assert table in capsys.readouterr().out


def test_bad_arguments_are_one_error(compare_runs, tmp_path):
    with pytest.raises(SystemExit):
        compare_runs.main([f"A{tmp_path}"])  # no LABEL=
    with pytest.raises(SystemExit):
        compare_runs.main([f"A={tmp_path / 'absent'}"])
    with pytest.raises(SystemExit, match="no evaluation"):
        compare_runs.main([f"A={tmp_path}", "--evals", "t0"])
