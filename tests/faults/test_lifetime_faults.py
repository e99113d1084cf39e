"""One lifetime (longspec.lifetime): no process outlives the one that started it, SIGKILL included, and a directory
whose lock a live process holds is never reused or removed; a stale lock is taken over with one line.

Real processes where the kernel's part is the point: a parent SIGKILLed under its child (preexec arm), and the
pipeline's runner SIGKILLed under a 2-process torchrun training (the whole chain: runner -> torchrun -> workers).
The fallback (a launcher gone without the signal) stops a real trainer at its next step. The lock rules, the
pipeline's run-directory guard and data_prep's lock on --out run in process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fault_helpers import (
    REPO_ROOT,
    assert_one_line_error,
    assert_only_changed,
    run_in_process,
    tiny_train_world,
    tree_checksums,
)
from process_helpers import child_pids, pid_running

from longspec import lifetime
from longspec.lifetime import (
    LAUNCHERS_ENV,
    LOCK_NAME,
    RunLock,
    RunLockedError,
    child_env,
    exit_if_orphaned,
    orphaned,
    refuse_if_held,
    start_ticks,
)
from longspec.ownership import write_marker


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def _lock_of(pid: int, host: str | None = None) -> str:
    return json.dumps(
        {"pid": pid, "host": host or socket.gethostname(), "started": 0, "start_ticks": start_ticks(pid)}
    )


def _wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", LAUNCHERS_ENV)}
    env.update(PYTHONPATH=str(REPO_ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


# ---- the lock helper ---------------------------------------------------------------------------------------------
def test_a_live_lock_guards_its_directory_and_a_stale_one_is_said(tmp_path, caplog):
    lock = tmp_path / LOCK_NAME
    refuse_if_held(str(lock), "trainer")  # no lock: nothing to guard
    lock.write_text(_lock_of(os.getpid()))  # this live process stands for a running trainer
    with pytest.raises(RunLockedError, match=rf"{tmp_path} is in use by a trainer \(pid {os.getpid()} on "):
        refuse_if_held(str(lock), "trainer")
    lock.write_text(_lock_of(os.getpid(), host="some-other-host"))
    with pytest.raises(RunLockedError, match=rf"locked by a trainer on another host .* remove {lock}"):
        refuse_if_held(str(lock), "trainer")
    lock.write_text("not json")
    with pytest.raises(RunLockedError, match="is not a lock this project wrote"):
        refuse_if_held(str(lock), "trainer")
    lock.write_text(_lock_of(_dead_pid()))
    with caplog.at_level(logging.WARNING, logger="longspec.lifetime"):
        refuse_if_held(str(lock), "trainer")
    assert [r.getMessage() for r in caplog.records] == [
        f"taking over the stale lock {lock} (pid {json.loads(lock.read_text())['pid']} on "
        f"{socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(0))} is gone)"
    ]


def test_a_lock_not_taken_never_removes_the_holders(tmp_path):
    holder = RunLock(str(tmp_path), name="prep.lock", user="data prep", dir_option="--out", force_option=None)
    with holder:
        other = RunLock(
            str(tmp_path), name="prep.lock", user="data prep", dir_option="--out", force_option=None
        )
        with pytest.raises(
            RunLockedError, match=rf"{tmp_path} is in use by another data prep .*choose another --out"
        ):
            other.acquire()
        other.release()  # a failed run's cleanup: the holder's lock stays
        assert json.loads((tmp_path / "prep.lock").read_text()) == holder.owner
    assert os.listdir(tmp_path) == []  # released on leaving the block, no temp left


# ---- parent checks: the fallback of the signal -------------------------------------------------------------------
def test_orphaned_names_the_launcher_that_is_gone(monkeypatch):
    me = f"{os.getpid()}:{start_ticks(os.getpid())}"
    monkeypatch.setenv(LAUNCHERS_ENV, me)
    assert orphaned() is None
    assert (
        child_env({})[LAUNCHERS_ENV] == me and child_env({LAUNCHERS_ENV: "7:8"})[LAUNCHERS_ENV] == f"7:8,{me}"
    )
    dead = _dead_pid()
    monkeypatch.setenv(LAUNCHERS_ENV, f"{me},{dead}:")
    assert orphaned() == f"the process that started it (pid {dead}) is gone"
    monkeypatch.setenv(LAUNCHERS_ENV, f"{os.getpid()}:{start_ticks(os.getpid()) - 1}")  # this pid, reused
    with pytest.raises(
        SystemExit, match=rf"^error: stopping: the process that started it \(pid {os.getpid()}\)"
    ):
        exit_if_orphaned()
    monkeypatch.delenv(LAUNCHERS_ENV)
    monkeypatch.setattr(lifetime, "_launcher", os.getppid() + 1)  # a worker whose launcher's pid was another
    assert orphaned() == f"its launcher (pid {os.getppid() + 1}) is gone"


# ---- SIGKILL of the parent ---------------------------------------------------------------------------------------
def test_a_child_dies_with_its_sigkilled_parent(tmp_path):
    """The runner's way to start a child (child_preexec): the parent SIGKILLed, the child is gone at once."""
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import subprocess, sys, time
            from longspec.lifetime import child_preexec
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=child_preexec())
            time.sleep(120)
        """)],
        env=_env(),
        start_new_session=True,  # its own group: the test kills the parent alone, never the group
    )  # fmt: skip
    children: list[int] = []
    try:
        _wait_until(lambda: child_pids(parent.pid), 30, "the child to start")
        children = child_pids(parent.pid)
        parent.kill()
        parent.wait()
        _wait_until(
            lambda: not any(map(pid_running, children)), 5, f"the child {children} to die with its parent"
        )
    finally:
        for pid in [parent.pid, *children]:
            if pid_running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return tiny_train_world(tmp_path_factory.mktemp("lifetime"))


def _train_args(world: Path, run: str) -> list[str]:
    return ["stage=tiny_stage1", "target=tiny_llama", f"target.path={world / 'tiny_llama'}",
            f"data.path={world / 'd1'}", f"output_dir={world / run}", "max_steps=1000",
            "checkpoint.save_every=1000"]  # fmt: skip


def _trained(run: Path) -> bool:
    """Step 1 is logged (metrics.jsonl is created empty before it)."""
    return (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_of_the_pipeline_kills_torchrun_and_its_workers(world):
    """The pipeline's runner (run_pipeline, as `python -m longspec.pipeline` runs a training step) SIGKILLed while
    torchrun trains: torchrun and both workers are gone within seconds, nothing is left training."""
    run = world / "run_pipeline_kill"
    script = textwrap.dedent(f"""
        import sys
        from longspec.pipeline.plan import Step
        from longspec.pipeline.runner import run_pipeline
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "longspec.train", *{_train_args(world, run.name)!r}]
        run_pipeline([Step(name="train", cmd=cmd, outputs=[], env={{"DS_ACCELERATOR": "cpu"}})], {str(world)!r})
    """)
    pipeline = subprocess.Popen(
        [sys.executable, "-c", script], env=_env(), cwd=REPO_ROOT, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    tree: list[int] = []
    try:
        _wait_until(lambda: _trained(run) or pipeline.poll() is not None, 240, "step 1")
        assert pipeline.poll() is None, (world / "logs" / "01_train.log").read_text()[-3000:]
        (torchrun,) = child_pids(pipeline.pid)
        tree = [torchrun, *child_pids(torchrun)]
        assert len(tree) == 3, f"torchrun and 2 workers, got {tree}"
        pipeline.kill()  # the runner alone: its children must follow by themselves
        pipeline.wait()
        _wait_until(lambda: not any(map(pid_running, tree)), 10, f"{tree} to die with the pipeline")
    finally:
        for pid in [pipeline.pid, *tree]:
            if pid_running(pid):  # never leave a run training in the background, even when the test fails
                os.kill(pid, signal.SIGKILL)
    # Rank 0's lock: stale (the signal killed it) or released (its next step's check of the pipeline came first)
    assert not (run / LOCK_NAME).exists() or json.loads((run / LOCK_NAME).read_text())["pid"] in tree


@pytest.mark.slow
def test_a_trainer_whose_launcher_is_gone_stops_at_its_next_step(world):
    """The fallback, where no parent-death signal came: the process named in LONGSPEC_LAUNCHERS (a stand-in for
    the pipeline) ends, and the trainer stops before its next step with one line, its lock released."""
    run = world / "run_orphan"
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    env = {**_env(), LAUNCHERS_ENV: f"{launcher.pid}:{start_ticks(launcher.pid)}"}
    trainer = subprocess.Popen(
        [sys.executable, "-m", "longspec.train", *_train_args(world, run.name)],
        env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_until(lambda: _trained(run) or trainer.poll() is not None, 240, "step 1")
        launcher.kill()
        launcher.wait()
        _, stderr = trainer.communicate(timeout=60)
    finally:
        for proc in (launcher, trainer):
            if proc.poll() is None:
                proc.kill()
    assert trainer.returncode == 1, stderr[-3000:]
    assert_one_line_error(
        stderr,
        rf"^error: stopping: the process that started it \(pid {launcher.pid}\) is gone$",
        exclusive=False,
    )
    steps = (run / "metrics.jsonl").read_text().splitlines()
    assert 1 <= len(steps) < 1000 and not (run / LOCK_NAME).exists()


# ---- the pipeline never reuses nor removes a live run's directory -------------------------------------------------
def _train_step(tmp_path: Path):
    from longspec.pipeline import load_preset
    from longspec.pipeline.plan import stage_steps

    preset = load_preset("demo_tiny")
    run = tmp_path / "out" / "runs" / "stage1"
    (step, _) = stage_steps(
        preset, "stage1", preset.stage1, target_overrides=[], data_path=str(tmp_path / "d1"), run_dir=str(run)
    )
    return step, run


def test_the_pipeline_neither_removes_nor_reuses_a_live_run_directory(tmp_path):
    step, run = _train_step(tmp_path)
    step.fn()  # the pipeline's own fresh run directory
    (run / "checkpoints").mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / LOCK_NAME).write_text(_lock_of(os.getpid()))  # a live trainer (a killed pipeline's orphan)
    before = tree_checksums(tmp_path)
    with pytest.raises(
        RunLockedError, match=rf"^{run} is in use by a trainer \(pid {os.getpid()} on .*stop it"
    ):
        step.fn()
    assert_only_changed(tmp_path, before)


def test_the_pipeline_takes_over_a_stale_run_directory_with_one_line(tmp_path, caplog):
    step, run = _train_step(tmp_path)
    step.fn()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / LOCK_NAME).write_text(_lock_of(_dead_pid()))
    with caplog.at_level(logging.WARNING, logger="longspec.lifetime"):
        step.fn()  # the stage restarts: the dead run's directory goes, its lock with it
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"taking over the stale lock {run / LOCK_NAME}"
    ]
    assert not (run / "metrics.jsonl").exists() and not (run / LOCK_NAME).exists()


def test_a_pipeline_rerun_is_refused_before_any_step_while_a_run_directory_is_live(tmp_path, capsys):
    from longspec.pipeline.__main__ import PIPELINE_KIND, main
    from longspec.train.checkpoint import RUN_KIND

    out = tmp_path / "out"
    run = out / "runs" / "stage1"
    run.mkdir(parents=True)
    write_marker(out, PIPELINE_KIND)  # an earlier pipeline's --out (longspec.ownership)
    write_marker(run, RUN_KIND)
    (run / LOCK_NAME).write_text(_lock_of(os.getpid()))
    before = tree_checksums(tmp_path)
    status, err = run_in_process(main, ["--preset", "demo_tiny", "--out", str(out)], capsys)
    assert status == 2
    assert_one_line_error(err, rf"^error: {run} is in use by a trainer \(pid {os.getpid()} on ")
    assert_only_changed(tmp_path, before)  # no lock, log or run record written


# ---- data_prep locks its --out -----------------------------------------------------------------------------------
@pytest.fixture()
def prep(tmp_path):
    from longspec.pipeline.presets import CODE_TARGET

    source = tmp_path / "src.jsonl"
    source.write_text(
        "".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(40))
    )
    out = tmp_path / "d1"
    return out, ["--source", str(source), "--tokenizer", CODE_TARGET, "--out", str(out), "--seq-len", "32",
                 "--no-progress"]  # fmt: skip


def test_a_second_data_prep_on_a_live_out_is_refused_untouched(tmp_path, prep, capsys):
    from data_prep import stage1

    out, argv = prep
    out.mkdir()
    write_marker(out, "data")  # the running prep's --out (longspec.ownership)
    (out / "shard_00000.tokens.bin.tmp-1").write_bytes(b"the running prep's shard")
    (out / "prep.lock").write_text(_lock_of(os.getpid()))  # a data prep running on this --out
    before = tree_checksums(tmp_path)
    status, err = run_in_process(stage1.main, argv, capsys)
    assert status == 2
    assert_one_line_error(
        err, rf"^error: {out} is in use by another data prep \(pid {os.getpid()} on .* --out$"
    )
    assert_only_changed(tmp_path, before)


def test_a_data_prep_takes_over_a_stale_lock_and_releases_its_own(tmp_path, prep, capsys, caplog):
    from data_prep import stage1
    from longspec.data import ShardReader

    out, argv = prep
    out.mkdir()
    write_marker(out, "data")
    (out / "prep.lock").write_text(_lock_of(_dead_pid()))  # a prep killed mid-run
    with caplog.at_level(logging.WARNING, logger="longspec.lifetime"):
        status, _ = run_in_process(stage1.main, argv, capsys)
    assert status == 0
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"taking over the stale lock {out / 'prep.lock'}"
    ]
    assert len(ShardReader(str(out))) > 0 and not (out / "prep.lock").exists()


def test_regenerate_on_a_live_out_is_refused_before_the_model_loads(tmp_path, capsys):
    from data_prep import stage3_regenerate

    out = tmp_path / "answers.jsonl"
    out.write_text('{"id": "p0", "response": "x", "finished": true}\n')
    (tmp_path / "answers.jsonl.lock").write_text(_lock_of(os.getpid()))
    before = tree_checksums(tmp_path)
    status, err = run_in_process(
        stage3_regenerate.main,
        ["--source", str(tmp_path / "none.jsonl"), "--target", str(tmp_path / "none"), "--out", str(out)],
        capsys,
    )
    assert status == 2
    assert_one_line_error(err, rf"^error: {tmp_path} is in use by another data prep \(pid {os.getpid()} on ")
    assert_only_changed(tmp_path, before)


def test_a_data_prep_whose_launcher_is_gone_stops_at_its_next_batch(monkeypatch):
    """The fallback of the parent-death signal in data_prep: every batch of a prep (stage 1 / 2, regenerate,
    bundle) first checks the launchers in LONGSPEC_LAUNCHERS; a gone one stops it with one line."""
    from data_prep.common import batched

    monkeypatch.setenv(lifetime.LAUNCHERS_ENV, str(os.getpid()))
    assert list(batched(range(5), 2)) == [[0, 1], [2, 3], [4]]
    monkeypatch.setenv(lifetime.LAUNCHERS_ENV, str(_dead_pid()))
    with pytest.raises(SystemExit, match=r"error: stopping: the process that started it \(pid \d+\) is gone"):
        next(batched(range(5), 2))
