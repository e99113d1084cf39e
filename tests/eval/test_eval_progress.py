"""A stopped evaluation loses none of its finished samples: each finished chunk is on disk
(OUT/results.partial.jsonl), and a rerun of the same configuration reads them back and decodes only the rest."""

import json

import pytest

from longspec.eval import sample_runs
from longspec.eval.config import load_eval_config
from longspec.eval.harness import run_eval
from longspec.eval.progress import PARTIAL_NAME


class _Stopped(Exception):
    pass


def _counting(monkeypatch, *, stop_at: int | None = None) -> list[int]:
    """Count the chunks decoded; raise at the `stop_at`-th (a kill mid-run)."""
    calls, real = [], sample_runs.timed_runs

    def timed_runs(*args, **kwargs):
        calls.append(1)
        if stop_at is not None and len(calls) == stop_at:
            raise _Stopped
        return real(*args, **kwargs)

    monkeypatch.setattr(sample_runs, "timed_runs", timed_runs)
    return calls


def test_a_stopped_run_continues_with_the_samples_it_had_not_finished(eval_overrides, tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg = load_eval_config([*eval_overrides(out), "method=[longspec,ar]"])
    full = run_eval(load_eval_config([*eval_overrides(tmp_path / "full"), "method=[longspec,ar]"]))
    assert not (tmp_path / "full" / PARTIAL_NAME).exists()  # removed once results.json is written

    _counting(monkeypatch, stop_at=2)
    with pytest.raises(_Stopped):  # the first of the two samples finished, then the run died
        run_eval(cfg)
    lines = (out / PARTIAL_NAME).read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["start"] == 0 and not (out / "results.json").exists()

    calls = _counting(monkeypatch)
    resumed = run_eval(cfg)
    assert len(calls) == 1  # only the unfinished sample was decoded
    assert resumed["resumed"] == {"rows": 1}
    for method in ("longspec", "ar"):
        got = [r["output_ids"] for r in resumed["methods"][method]["rows"]]
        assert got == [r["output_ids"] for r in full["methods"][method]["rows"]]
    assert resumed["summary"]["rows"]["longspec"]["identical_to_greedy"] == 1.0
    assert (
        "Continued from a stopped run of this configuration: 1 sample(s)" in (out / "report.md").read_text()
    )
    assert not (out / PARTIAL_NAME).exists()


def test_another_configuration_or_a_cut_line_is_not_read_back(eval_overrides, tmp_path, monkeypatch):
    out = tmp_path / "run"
    _counting(monkeypatch, stop_at=2)
    with pytest.raises(_Stopped):
        run_eval(load_eval_config([*eval_overrides(out), "method=[ar]"]))
    # another max_new_tokens: the finished sample belongs to another run, and is decoded again
    calls = _counting(monkeypatch)
    other = run_eval(load_eval_config([*eval_overrides(out), "method=[ar]", "max_new_tokens=8"]))
    assert len(calls) == 2 and "resumed" not in other

    _counting(monkeypatch, stop_at=2)
    with pytest.raises(_Stopped):
        run_eval(load_eval_config([*eval_overrides(out), "method=[ar]"]))
    partial = out / PARTIAL_NAME
    partial.write_text(partial.read_text()[:-20])  # a kill in the middle of writing the chunk's line
    calls = _counting(monkeypatch)
    again = run_eval(load_eval_config([*eval_overrides(out), "method=[ar]"]))
    assert len(calls) == 2 and "resumed" not in again


def test_two_sources_of_one_file_name_stay_apart(eval_overrides, tmp_path, monkeypatch):
    """a/rows.jsonl and b/rows.jsonl: results, the lossless check and a stopped run's chunks are keyed by the
    dataset name, a file's base name. They were merged as one dataset "rows", and a rerun read a's chunks back
    in b's place (b's samples "decoded" with a's outputs). Now the second is "rows_2", each kept apart."""
    sources = []
    for folder, words in (("a", "alpha beta gamma. "), ("b", "one two three four. ")):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "rows.jsonl"
        rows = [{"_id": f"{folder}{i}", "context": words * (i + 2), "input": ""} for i in range(2)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        sources.append(str(path))

    def overrides(out):
        kept = [o for o in eval_overrides(out) if not o.startswith("data.path")]
        return [*kept, f"data.name=[{','.join(sources)}]", "method=[longspec,ar]", "warmup=false"]

    full = run_eval(load_eval_config(overrides(tmp_path / "full")))
    assert [r["dataset"] for r in full["data"]] == ["rows", "rows_2"]
    for method in ("longspec", "ar"):
        assert {d: [r["id"] for r in rs] for d, rs in full["methods"][method].items()} == {
            "rows": ["a0", "a1"],
            "rows_2": ["b0", "b1"],
        }
    assert all(full["summary"][d]["longspec"]["identical_to_greedy"] == 1.0 for d in ("rows", "rows_2"))

    out = tmp_path / "run"
    _counting(monkeypatch, stop_at=4)  # a's two samples and b's first finished, then the run died
    with pytest.raises(_Stopped):
        run_eval(load_eval_config(overrides(out)))
    calls = _counting(monkeypatch)
    resumed = run_eval(load_eval_config(overrides(out)))
    assert len(calls) == 1 and resumed["resumed"] == {"rows": 2, "rows_2": 1}
    for method in ("longspec", "ar"):
        for dataset in ("rows", "rows_2"):
            got = [r["output_ids"] for r in resumed["methods"][method][dataset]]
            assert got == [r["output_ids"] for r in full["methods"][method][dataset]], (method, dataset)
