"""`python -m longspec.pipeline` (longspec.pipeline.__main__): a real mini run through every CLI (slow)."""

from __future__ import annotations

import json
import os
import sysconfig

import pytest

from longspec.pipeline import RUN_RECORD_NAME
from longspec.pipeline.__main__ import main


@pytest.mark.slow
@pytest.mark.distributed
def test_mini_run_end_to_end(tmp_path):
    """The whole pipeline through the real CLIs at toy sizes (2 training steps per stage, 8 new tokens)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    corpus = tmp_path / "data" / "corpus"
    corpus.mkdir(parents=True)
    train_files = ["json/decoder.py", "json/encoder.py", "json/scanner.py", "abc.py", "bisect.py", "heapq.py"]
    with open(corpus / "train.jsonl", "w") as f:
        for name in train_files:
            f.write(json.dumps({"text": open(os.path.join(stdlib, name)).read(), "path": name}) + "\n")
    context = open(os.path.join(stdlib, "textwrap.py")).read()[:2500]
    cut = context.rfind("\n") + 1
    row = {"_id": "t", "input": "", "context": context[:cut], "answers": ["x"], "dataset": "lcc"}
    (corpus / "heldout_lcc.jsonl").write_text(json.dumps(row) + "\n")
    sets = [
        "stage1_max_rows=6", "stage2_max_rows=6", "stage2_min_tokens=64", "num_prompts=4", "prompt_chars=400",
        "regen_max_new_tokens=8", "eval_max_new_tokens=8", "eval_max_samples=1", "eval_min_prompt_tokens=100",
        "tree_widths=[2,2]", "window=16",
        "stage1.train.stage.seq_len=64", "stage1.train.max_steps=2", "stage1.train.stage.global_batch_size=4",
        "stage1.train.stage.micro_batch_size=2",
        "stage2.train.stage.seq_len=128", "stage2.train.max_steps=2", "stage2.train.stage.global_batch_size=4",
        "stage2.train.stage.micro_batch_size=2",
        "stage3.train.stage.seq_len=256", "stage3.train.max_steps=2", "stage3.train.stage.global_batch_size=4",
        "stage3.train.stage.micro_batch_size=2",
    ]  # fmt: skip
    out = tmp_path / "out"
    argv = ["--preset", "cpu", "--out", str(out), "--data", str(tmp_path / "data")]
    argv += [a for s in sets for a in ("--set", s)]
    assert main(argv) == 0
    summary = json.loads((out / "e2e_summary.json").read_text())
    methods = {r["method"]: r for r in summary["eval"]}
    assert set(methods) == {"longspec", "vanilla_hf", "ar", "pld"}
    assert all(r["identical"] == 1 for r in methods.values())  # lossless at T=0
    assert methods["longspec"]["tau"] >= 1.0
    assert [s["steps"] for s in summary["training"]] == [2, 2, 2]
    assert (out / "report.md").exists() and (out / "training_loss.png").exists()
    # rerun: everything is skipped, the report is rewritten
    assert main(argv) == 0
    manifest = json.loads((out / RUN_RECORD_NAME).read_text())
    assert all(record["status"] == "done" for record in manifest["steps"].values())


def test_the_lossless_check_names_each_failing_row_and_its_distance(capsys):
    """A greedy row whose output leaves the reference past a near-tie fails the run, and the message names the row
    with the report's text (how many ulps past the tolerance); near-ties alone pass, with a note; sampled rows are
    not judged."""
    from longspec.pipeline.report import lossless_check

    def row(method, identical, unexplained, text, temperature=0.0):
        return {"run": "t0", "temperature": temperature, "dataset": "d", "method": method, "identical": identical,
                "unexplained": unexplained, "identical_text": text}  # fmt: skip

    tie = row("pld", 0.5, 0, "50% (1 near-tie, logit gap <= 0.125)")
    real = row(
        "longspec", 0.5, 1, "50% (1 NOT a near-tie, logit gap up to 3.76 ulp against a tolerance of 2)"
    )
    assert not lossless_check([tie, real, row("longspec", None, None, "n/a", temperature=1.0)])
    err = capsys.readouterr().err
    assert (
        "LOSSLESS CHECK FAILED" in err
        and "t0 / d / longspec: 50% (1 NOT a near-tie, logit gap up to 3.76" in err
    )
    assert "pld" not in err
    assert lossless_check([tie, row("ar", 1.0, 0, "yes")])
    assert "lossless check passed" in capsys.readouterr().out


def test_an_out_that_is_a_file_or_holds_no_run_is_one_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["--preset", "demo_tiny", "--out", str(afile)]) == 2
    assert "error: --out " in capsys.readouterr().err  # was "[Errno 20] Not a directory: '.../afile/logs'"
    assert main(["--preset", "demo_tiny", "--out", str(tmp_path / "none"), "--report-only"]) == 2
    assert "holds no pipeline run" in capsys.readouterr().err  # was "No such file ...: '.../report.md'"
    assert not (tmp_path / "none").exists()


def test_sigterm_stops_the_step_and_says_so_in_one_line(tmp_path):
    """A job scheduler's SIGTERM mid-step: the step's process is stopped, stderr says to rerun (no traceback)."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from process_helpers import child_pids, pid_running

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "longspec.pipeline", "--preset", "demo_tiny", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    steps = []
    while not steps and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
        steps = child_pids(proc.pid)  # the corpus step's process
    assert steps, "the first step did not start"
    time.sleep(0.5)  # past Popen's return: the runner is waiting on the step (its _watch)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "Exception ignored" not in err, err  # was a KeyboardInterrupt traceback
    assert "interrupted (signal 15): the running step was stopped; rerun the same command" in err
    assert not any(pid_running(pid) for pid in steps)


def test_a_second_pipeline_on_the_same_out_is_refused_before_any_step(tmp_path, capsys):
    """A second run on a live run's --out (a requeued job) removed the live training run's directory and
    overwrote its run record; it is refused while the first holds OUT/pipeline.lock, and a dead one's is taken."""
    from longspec.lifetime import RunLock
    from longspec.ownership import MARKER_NAME, claim_output_dir
    from longspec.pipeline.__main__ import PIPELINE_KIND, PIPELINE_LOCK

    out = tmp_path / "out"
    claim_output_dir(out, PIPELINE_KIND)  # as the first pipeline did before taking its lock
    first = RunLock(str(out), name=PIPELINE_LOCK)
    first.acquire()  # this live process stands for the first pipeline
    try:
        assert main(["--preset", "demo_tiny", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"error: {out} is in use by another pipeline run (pid {os.getpid()}" in err
        assert "choose another --out" in err
        assert sorted(os.listdir(out)) == sorted(
            [MARKER_NAME, PIPELINE_LOCK]
        )  # no step ran: no logs/, no record
        assert main(["--preset", "demo_tiny", "--out", str(out), "--dry-run"]) == 0  # a dry run takes no lock
    finally:
        first.release()
