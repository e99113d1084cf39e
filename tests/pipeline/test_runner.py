"""The pipeline's runner (longspec.pipeline.runner): resume from the run record, reruns, dry runs, failures."""

from __future__ import annotations

import json
import os
import sys

import pytest

from longspec.pipeline import RUN_RECORD_NAME, Step, run_pipeline


def _echo_step(name: str, out_file: str, text: str) -> Step:
    code = f"open({out_file!r}, 'w').write({text!r}); print('step 1/1 | wrote')"
    return Step(name=name, cmd=[sys.executable, "-c", code], outputs=[out_file])


def test_run_pipeline_resumes_and_reruns_from_the_first_changed_step(tmp_path, capsys):
    out = str(tmp_path)
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
    steps = [_echo_step("first", a, "1"), _echo_step("second", b, "2")]
    assert run_pipeline(steps, out) == {"first": "done", "second": "done"}
    assert open(a).read() == "1" and open(b).read() == "2"
    assert "$ python -c" in capsys.readouterr().out  # the command is printed before it runs
    # same plan, outputs present -> nothing runs
    assert run_pipeline(steps, out) == {"first": "skipped", "second": "skipped"}
    # a changed command reruns that step and every later one (their inputs may have changed)
    steps2 = [_echo_step("first", a, "1b"), _echo_step("second", b, "2")]
    assert run_pipeline(steps2, out) == {"first": "done", "second": "done"}
    # a missing output reruns its step
    os.remove(b)
    assert run_pipeline(steps2, out) == {"first": "skipped", "second": "done"}
    manifest = json.loads((tmp_path / RUN_RECORD_NAME).read_text())
    assert manifest["steps"]["second"]["status"] == "done"
    assert (tmp_path / "logs" / "02_second.log").read_text().startswith("$ ")


def test_run_pipeline_dry_run_and_failures(tmp_path, capsys):
    out = str(tmp_path)
    a = str(tmp_path / "a.txt")
    assert run_pipeline([_echo_step("first", a, "1")], out, dry_run=True) == {"first": "planned"}
    assert not os.path.exists(a)
    failing = Step(name="boom", cmd=[sys.executable, "-c", "raise SystemExit('bad input')"], outputs=[a])
    optional = Step(name="opt", cmd=failing.cmd, outputs=[a], required=False)
    assert run_pipeline([optional, _echo_step("after", a, "x")], out) == {"opt": "failed", "after": "done"}
    assert "bad input" in capsys.readouterr().out  # the log's tail is shown
    with pytest.raises(SystemExit, match="step boom failed"):
        run_pipeline([failing], out, force=True)
