"""tree="auto"'s measured round costs are kept on disk (`policy.cost_cache`): a later engine on the same device,
shape and dtype reads them instead of measuring; another shape or dtype, the re-measure flag, or a damaged file
measure again."""

import dataclasses
import json

import pytest
import torch
from infer_helpers import random_drafter

from longspec.infer.engine import GenerationConfig, SpeculativeEngine
from longspec.infer.policy import cost_cache
from longspec.infer.policy import measure as measure_module
from longspec.infer.policy.measure import cost_mode
from longspec.testing import make_tiny_target

CONFIG = GenerationConfig(max_new_tokens=4, auto_lookup=False)


@pytest.fixture
def timed(monkeypatch):
    """The rounds each measurement times (`measure._time_rounds` stubbed: a cost per candidate's size)."""
    calls = []

    def fake(engine, widths, *args):
        calls.append(widths)
        return 1e-3 * widths.nodes

    monkeypatch.setattr(measure_module, "_time_rounds", fake)
    return calls


def _measure(target, config=CONFIG):
    return SpeculativeEngine(target, random_drafter(target)).measure_round_costs(config, [10], reps=1)


def test_a_second_engine_reads_the_costs_the_first_measured(timed):
    target = make_tiny_target("llama")
    first = _measure(target)
    assert timed and len(list(cost_cache.cache_dir().glob("*.json"))) == 1
    timed.clear()
    second = _measure(target)  # a new engine: a new process's view
    assert timed == [] and second.seconds == first.seconds


def test_another_shape_or_dtype_measures_again(timed):
    _measure(make_tiny_target("llama"))
    timed.clear()
    _measure(make_tiny_target("llama", num_hidden_layers=3))
    assert timed
    timed.clear()
    _measure(make_tiny_target("llama").to(torch.float64))
    assert timed
    assert len(list(cost_cache.cache_dir().glob("*.json"))) == 3


def test_the_remeasure_flag_measures_again_and_stores_the_new_table(timed):
    target = make_tiny_target("llama")
    _measure(target)
    timed.clear()
    again = _measure(target, dataclasses.replace(CONFIG, remeasure_costs=True))
    assert timed
    timed.clear()
    assert _measure(target).seconds == again.seconds and timed == []


@pytest.mark.parametrize("damage", ["{not json", '{"format": 1, "seconds": {"1024:nonsense": 1.0}}', "[]"])
def test_a_damaged_cache_file_is_ignored_with_a_warning_and_measured_again(timed, damage):
    target = make_tiny_target("llama")
    engine = SpeculativeEngine(target, random_drafter(target))
    path = cost_cache.cache_path(engine, cost_mode(CONFIG, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(damage)
    with pytest.warns(UserWarning, match="round-cost cache"):
        costs = engine.measure_round_costs(CONFIG, [10], reps=1)
    assert timed and json.loads(path.read_text())["seconds"] == costs.to_dict()  # the good table replaced it


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(cost_cache.CACHE_ENV, str(tmp_path / "mine"))
    assert cost_cache.cache_dir() == tmp_path / "mine" / "round_costs"
    monkeypatch.delenv(cost_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cost_cache.cache_dir() == tmp_path / "xdg" / "longspec" / "round_costs"


def test_a_second_eval_run_of_the_same_target_measures_nothing(tmp_path, monkeypatch):
    """The eval CLI twice on one tiny target (tree=auto): the first run measures the round costs, the second
    decodes on the stored table (and reports it)."""
    from longspec.eval.__main__ import main
    from longspec.testing import save_tiny_target

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps(
            {
                "_id": "0",
                "context": "def f(x):\n    return x\n" * 4,
                "input": "",
                "answers": ["f"],
                "dataset": "lcc",
            }
        )
        + "\n"
    )
    target = save_tiny_target("llama", tmp_path / "tiny")
    measured = []
    time_rounds = measure_module._time_rounds
    monkeypatch.setattr(
        measure_module, "_time_rounds", lambda *a: (measured.append(a[1]), time_rounds(*a))[1]
    )

    def run(name, *extra):
        out = tmp_path / name
        argv = [
            "target=tiny_llama", f"target.path={target}", f"data.path={rows}", "data.min_prompt_tokens=0",
            "drafter.init=random", "drafter.window=8", "max_new_tokens=6", "method=longspec", "device=cpu",
            f"output_dir={out}", *extra,
        ]  # fmt: skip
        assert main(argv) == 0
        return json.loads((out / "results.json").read_text())["round_costs_s"]

    first = run("first")
    assert measured
    measured.clear()
    assert run("second") == first and measured == []
