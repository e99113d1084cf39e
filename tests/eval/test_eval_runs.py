"""Several evaluations in one process (`python -m longspec.eval.runs`, `EvalSession`): the models loaded once,
results equal to separate runs, a failed run does not stop the next, bad command lines fail before any load."""

import json

import pytest
import torch

from longspec.eval.config import load_eval_config
from longspec.eval.harness import run_eval
from longspec.eval.runs import main
from longspec.eval.session import EvalSession


def _outputs(results: dict) -> dict:
    return {
        method: [s["output_ids"] for s in per_dataset["rows"]]
        for method, per_dataset in results["methods"].items()
    }


def test_runs_share_the_models_and_equal_separate_runs(eval_overrides, tmp_path):
    common = eval_overrides(None)
    plans = [
        ["method=[longspec,ar]", "tree_widths=[2,2]"],
        ["method=[longspec,pld]"],  # tree=auto: the round costs measured on the shared engine
        ["method=longspec", "temperature=1.0", "tree_widths=[2,2]", "seed=3"],
        ["method=longspec", "tree_widths=[2,2]", "drafter.seed=1"],  # another random drafter: a new engine
    ]
    session = EvalSession()
    shared = [run_eval(load_eval_config([*common, *p, f"output_dir={tmp_path / f'shared{i}'}"]), session)
              for i, p in enumerate(plans)]  # fmt: skip
    assert session.loads == 1  # one target for all four
    for i, plan in enumerate(plans):
        alone = run_eval(load_eval_config([*common, *plan, f"output_dir={tmp_path / f'alone{i}'}"]))
        # token for token, at T=0 and (fixed tree, same seed) at T=1: sharing changes nothing a run outputs
        assert _outputs(shared[i]) == _outputs(alone), plan


def test_a_new_dtype_loads_the_target_again(eval_overrides, tmp_path):
    common = [*eval_overrides(None), "method=ar", "warmup=false", "max_samples=1"]
    session = EvalSession()
    run_eval(load_eval_config([*common, f"output_dir={tmp_path / 'a'}"]), session)
    first = session.engine
    run_eval(load_eval_config([*common, "dtype=bfloat16", f"output_dir={tmp_path / 'b'}"]), session)
    assert session.loads == 2 and session.engine is not first
    assert session.engine.target.embed_tokens.weight.dtype == torch.bfloat16
    run_eval(load_eval_config([*common, "dtype=bfloat16", f"output_dir={tmp_path / 'c'}"]), session)
    assert session.loads == 2  # the same again: reused


def test_runs_cli_goes_on_after_a_failed_run(eval_overrides, tmp_path, caplog):
    caplog.set_level("INFO", logger="longspec.eval")
    events = tmp_path / "events.jsonl"
    empty_drafter = tmp_path / "not_a_drafter"
    empty_drafter.mkdir()
    code = main([
        *eval_overrides(None), "--events", str(events), "max_samples=1",
        "--run", "method=longspec", "drafter.init=pretrained", f"drafter.path={empty_drafter}", "drafter.window=null",
        f"output_dir={tmp_path / 'bad'}",
        "--run", "method=[longspec,ar]", f"output_dir={tmp_path / 'good'}",
    ])  # fmt: skip
    assert code == 1  # one run failed
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["run"], e["status"]) for e in lines] == [(1, "failed"), (2, "done")]
    assert lines[1]["output_dir"] == str(tmp_path / "good") and lines[1]["seconds"] > 0
    assert not (tmp_path / "bad" / "results.json").exists()
    assert json.loads((tmp_path / "good" / "results.json").read_text())["summary"]["rows"]["ar"]
    assert "run 1/2" in caplog.text and "failed" in caplog.text
    assert "targets loaded so far: 2" in caplog.text  # the run after a failure loads its models afresh


@pytest.mark.parametrize(
    "args, message",
    [
        (["method=ar"], "no --run"),
        (
            ["--run", "method=ar", "output_dir=x", "--run", "method=nope", "output_dir=y"],
            "run 2 (method=nope",
        ),
        (
            ["--run", "method=ar", "output_dir=same", "--run", "method=pld", "output_dir=same"],
            "different output_dir",
        ),
    ],
)
def test_runs_cli_rejects_a_bad_command_line_before_any_run(
    eval_overrides, tmp_path, monkeypatch, capsys, args, message
):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main([*eval_overrides(None), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not any(cwd.iterdir())  # nothing ran, nothing written
