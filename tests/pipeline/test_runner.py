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
    # a changed command reruns that step and every later one (their inputs may have changed); a dry run plans
    # the same, and both say why each finished step runs again
    steps2 = [_echo_step("first", a, "1b"), _echo_step("second", b, "2")]
    capsys.readouterr()
    assert run_pipeline(steps2, out, dry_run=True) == {"first": "planned", "second": "planned"}
    printed = capsys.readouterr().out
    assert "first: its settings changed since it ran" in printed
    assert "second: an earlier step runs again" in printed
    assert open(a).read() == "1"  # nothing ran
    assert run_pipeline(steps2, out) == {"first": "done", "second": "done"}
    assert "first: its settings changed since it ran, so it runs again" in capsys.readouterr().out
    # a missing output reruns its step
    os.remove(b)
    assert run_pipeline(steps2, out) == {"first": "skipped", "second": "done"}
    assert "second: its outputs are missing, so it runs again" in capsys.readouterr().out
    assert run_pipeline(steps2, out, dry_run=True, force=True) == {"first": "planned", "second": "planned"}
    assert "first: --force runs it again" in capsys.readouterr().out
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


def _joint_command(steps: list[Step], events: str) -> list[str]:
    """A stand-in for `longspec.eval.runs`: one process writes each step's output (its own pid) and an event line
    per step; a step whose text is 'fail' gets a failed event, one whose text is 'die' ends the process."""
    jobs = [(os.path.dirname(s.outputs[0]), s.outputs[0], s.cmd[-1]) for s in steps]
    code = f"""
import json, os, sys
for out_dir, path, text in {jobs!r}:
    if text == "die":
        sys.exit(3)
    if text != "fail":
        open(path, "w").write(str(os.getpid()))
    with open({events!r}, "a") as f:
        f.write(json.dumps({{"output_dir": out_dir, "status": "failed" if text == "fail" else "done",
                            "seconds": 1.5}}) + "\\n")
"""
    return [sys.executable, "-c", code]


def _joint_step(tmp_path, name: str, text: str, *, required: bool = True) -> Step:
    out_dir = tmp_path / name
    out_dir.mkdir(exist_ok=True)
    path = str(out_dir / "out.txt")
    return Step(name=name, cmd=[sys.executable, "-c", "unused", text], outputs=[path], joint=_joint_command,
                required=required)  # fmt: skip


def test_joint_steps_share_one_process_and_are_recorded_one_by_one(tmp_path, capsys):
    out = str(tmp_path)
    a = str(tmp_path / "a.txt")
    steps = [_echo_step("first", a, "1"), *(_joint_step(tmp_path, f"eval_{i}", "ok") for i in range(3))]
    assert run_pipeline(steps, out) == {"first": "done", "eval_0": "done", "eval_1": "done", "eval_2": "done"}
    pids = {open(s.outputs[0]).read() for s in steps[1:]}
    assert len(pids) == 1  # one process wrote all three
    record = json.loads((tmp_path / RUN_RECORD_NAME).read_text())["steps"]
    # each step recorded with its own seconds (from its event) and its own command (a rerun skips it alone)
    assert [record[f"eval_{i}"]["seconds"] for i in range(3)] == [1.5, 1.5, 1.5]
    assert record["eval_1"]["command"] == steps[2].command
    assert "one process for eval_0, eval_1, eval_2" in capsys.readouterr().out
    assert run_pipeline(steps, out) == {"first": "skipped", "eval_0": "skipped", "eval_1": "skipped",
                                        "eval_2": "skipped"}  # fmt: skip


def test_an_interrupted_joint_group_resumes_with_the_steps_it_did_not_finish(tmp_path, capsys):
    out = str(tmp_path)
    ok, dies = _joint_step(tmp_path, "eval_a", "ok"), _joint_step(tmp_path, "eval_b", "die", required=False)
    opt_fail = _joint_step(tmp_path, "eval_c", "fail", required=False)
    # the process ends after the first step's event (a watchdog, a crash): the first is done, the rest failed
    assert run_pipeline([ok, dies, opt_fail], out) == {
        "eval_a": "done",
        "eval_b": "failed",
        "eval_c": "failed",
    }
    assert "FAILED (exit 3)" in capsys.readouterr().out
    # the rerun starts one process for the two that did not finish; a failed event fails its step alone
    fixed = _joint_step(tmp_path, "eval_b", "ok", required=False)
    assert run_pipeline([ok, fixed, opt_fail], out) == {
        "eval_a": "skipped",
        "eval_b": "done",
        "eval_c": "failed",
    }
    printed = capsys.readouterr().out
    assert "one process for eval_b, eval_c" in printed and "eval_a: done earlier" in printed
    # a required step that fails stops the pipeline after its group
    with pytest.raises(SystemExit, match="step eval_x failed"):
        run_pipeline([_joint_step(tmp_path, "eval_x", "fail")], out)


@pytest.mark.parametrize("text", ["{bad", "[]", '{"steps": []}'])
def test_a_damaged_run_record_is_one_error_naming_it(tmp_path, capsys, text):
    from longspec.ownership import write_marker
    from longspec.pipeline.__main__ import PIPELINE_KIND, main

    write_marker(tmp_path, PIPELINE_KIND)  # a pipeline's own --out
    (tmp_path / RUN_RECORD_NAME).write_text(text)  # was a bare JSONDecodeError line or a TypeError traceback
    assert main(["--preset", "demo_tiny", "--out", str(tmp_path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / RUN_RECORD_NAME} ") and "remove it to run every step" in err
    assert err.count("\n") == 1
