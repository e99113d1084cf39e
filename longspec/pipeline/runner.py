"""The pipeline's runner: runs planned steps in order as subprocesses (or in-process glue), logs each to
OUT/logs/NN_step.log, and records finished steps in the run record OUT/e2e_manifest.json so that a rerun skips
them (and reruns from the first changed step on)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from longspec.atomic import write_text_atomic
from longspec.lifetime import child_env, child_preexec
from longspec.ownership import NotOursError
from longspec.pipeline.plan import Step

__all__ = ["RUN_RECORD_NAME", "RunRecord", "run_pipeline"]

# The file name predates the package (it was longspec/e2e.py): kept so that a rerun continues an earlier run.
RUN_RECORD_NAME = "e2e_manifest.json"


_RECORD_FIX = "remove it to run every step again, or choose another --out"


class RunRecord:
    """OUT/e2e_manifest.json: per step, the command that produced its outputs, when, and how long it took."""

    def __init__(self, out: str):
        self.path = os.path.join(out, RUN_RECORD_NAME)
        self.data = {"steps": {}}
        if os.path.isfile(self.path):
            # A damaged record (a hand edit, a copy cut short) is one error naming it: it was a bare
            # JSONDecodeError line, or a TypeError traceback for JSON of another shape.
            with open(self.path, encoding="utf-8", errors="replace") as f:
                try:
                    self.data = json.load(f)
                except ValueError as e:
                    raise ValueError(f"{self.path} is damaged ({e}); {_RECORD_FIX}") from None
            if not isinstance(self.data, dict) or not isinstance(self.data.get("steps"), dict):
                raise ValueError(f"{self.path} is not a pipeline run record; {_RECORD_FIX}")

    def is_done(self, step: Step) -> bool:
        record = self.data["steps"].get(step.name)
        return (
            record is not None
            and record.get("status") == "done"
            and record.get("command") == step.command
            and all(os.path.exists(p) for p in step.outputs)
        )

    def record(self, step: Step, status: str, seconds: float) -> None:
        self.data["steps"][step.name] = {
            "command": step.command,
            "status": status,
            "seconds": round(seconds, 1),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        write_text_atomic(self.path, json.dumps(self.data, indent=1))  # a full disk leaves no temp file

    def rerun_note(self, step: Step, after_rerun: bool, forced: bool = False) -> str:
        """Why a step that finished before runs again (printed after its name), so that a user sees which
        outputs a changed setting replaces before it happens (`--dry-run` prints the same); "" for a first run."""
        record = self.data["steps"].get(step.name)
        if record is None or record.get("status") != "done":
            return ""
        if record.get("command") != step.command:
            return ": its settings changed since it ran, so it runs again and replaces its outputs"
        if forced:
            return ": --force runs it again and replaces its outputs"
        if after_rerun:
            return ": an earlier step runs again, so it runs again and replaces its outputs"
        return ": its outputs are missing, so it runs again"

    def seconds(self, name: str) -> float | None:
        record = self.data["steps"].get(name)
        return None if record is None else record.get("seconds")


# A training line "step 12/60 | ..." or a tqdm bar "| 3/8 [": progress of the running step.
_PROGRESS = re.compile(r"step (\d+)/(\d+)|\| *(\d+)/(\d+) \[")


def _start(step: Step, log_path: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **step.env}
    for key in ("WANDB_MODE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        # Nothing in the pipeline needs the network: fail fast instead of trying a hub that may be unreachable.
        env.setdefault(key, "disabled" if key == "WANDB_MODE" else "1")
    if step.fn is not None:
        step.fn()  # the preparation of a subprocess step (cleaning a stale run dir)
    with open(log_path, "w") as log:
        log.write(f"$ {step.command}\n")
        log.flush()
        # The step dies with the pipeline, SIGKILL included (torchrun takes its workers with it): a rerun never
        # finds the killed run's step still writing (longspec.lifetime).
        return subprocess.Popen(
            step.cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(env), preexec_fn=child_preexec()
        )


def _watch(proc: subprocess.Popen, log_path: str, bar) -> int:
    """Wait for `proc`, moving the progress bar from the log's step / tqdm lines."""
    position = 0
    try:
        while proc.poll() is None:
            time.sleep(0.5)
            position = _update_bar(bar, log_path, position)
    except BaseException:  # interrupted: do not leave the step running (torchrun forwards it to its workers)
        _stop(proc)
        raise
    _update_bar(bar, log_path, position)
    return proc.returncode


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _update_bar(bar, log_path: str, position: int) -> int:
    with open(log_path, errors="replace") as f:
        f.seek(position)
        chunk = f.read()
        position = f.tell()
    for line in re.split(r"[\r\n]", chunk):
        line = line.strip()
        if not line:
            continue
        match = _PROGRESS.search(line)
        if match:
            done, total = (int(g) for g in (match.groups()[:2] if match.group(1) else match.groups()[2:]))
            bar.total = total
            bar.n = done
        bar.set_postfix_str(line[-60:], refresh=False)
    bar.refresh()
    return position


def run_pipeline(
    steps: list[Step], out: str, *, dry_run: bool = False, force: bool = False, keep_going: bool = False
) -> dict[str, str]:
    """Run (or, dry_run, only print) the steps in order -> {step name: done|skipped|failed|planned}.

    A background step starts and the pipeline moves on; it is joined when the next foreground step ends.
    Consecutive steps that share a `joint` command (the evaluations) run in one process; each is still recorded
    on its own, as it finishes, so an interrupted run continues with the ones that did not.
    keep_going: a failed step does not stop the pipeline, and a step whose inputs are missing runs its first
    alternative whose inputs exist (the evaluation with an earlier stage's drafter, or the baselines alone)."""
    from tqdm.auto import tqdm

    if not dry_run:
        os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    run_record = RunRecord(out)
    statuses: dict[str, str] = {}
    background: list[tuple[Step, subprocess.Popen, str, float]] = []
    joint: list[tuple[int, Step]] = []  # resolved steps waiting for the rest of their joint group

    def finish(step: Step, code: int, log_path: str, seconds: float) -> None:
        if code == 0 and all(os.path.exists(p) for p in step.outputs):
            run_record.record(step, "done", seconds)
            statuses[step.name] = "done"
            print(f"  {step.name}: done in {seconds:.1f} s (log: {_short(log_path)})", flush=True)
            return
        run_record.record(step, "failed", seconds)
        statuses[step.name] = "failed"
        print(f"  {step.name}: FAILED (exit {code}) after {seconds:.1f} s; last lines of {log_path}:")
        print(_tail(log_path, 20), flush=True)
        if step.required and not keep_going:
            for _, proc, _, _ in background:
                proc.terminate()
            raise SystemExit(f"step {step.name} failed; fix it and rerun the same command to continue")

    def join_background() -> None:
        while background:
            step, proc, log_path, start = background[0]
            try:
                code = proc.wait()
            except BaseException:
                for _, other, _, _ in background:
                    _stop(other)
                raise
            background.pop(0)
            finish(step, code, log_path, time.perf_counter() - start)

    def run_joint() -> None:
        if not joint:
            return
        group = list(joint)
        joint.clear()
        try:
            _run_joint(group, out, finish, tqdm)
        except BaseException:
            for _, other, _, _ in background:
                _stop(other)
            raise
        join_background()

    rerun = force  # once a step reruns, every later step reruns too: its inputs changed
    for index, step in enumerate(steps, 1):
        if joint and step.joint is not joint[0][1].joint:
            run_joint()
        header = f"[{index}/{len(steps)}] {step.name}"
        if keep_going and not dry_run and not all(os.path.exists(p) for p in step.needs):
            usable = [alt for alt in step.alternatives if all(os.path.exists(p) for p in alt.needs)]
            if not usable:
                print(f"{header}: its inputs are missing ({', '.join(step.needs)}), skipped")
                statuses[step.name] = "failed"
                continue
            print(f"{header}: inputs missing, running a fallback")
            step = usable[0]
        if not rerun and run_record.is_done(step):
            print(f"{header}: done earlier ({run_record.seconds(step.name)} s), skipped")
            statuses[step.name] = "skipped"
            continue
        print(
            f"{header}{run_note(step)}{run_record.rerun_note(step, rerun, force)}\n  $ {step.command}",
            flush=True,
        )
        rerun = True  # a dry run plans what the run would do: every later step runs again too
        if dry_run:
            statuses[step.name] = "planned"
            continue
        if step.joint is not None:
            joint.append((index, step))
            continue
        log_path = os.path.join(out, "logs", f"{index:02d}_{step.name}.log")
        start = time.perf_counter()
        if step.background and step.cmd is not None:
            background.append((step, _start(step, log_path), log_path, start))
            continue
        try:
            code = _run_foreground(step, log_path, tqdm)
        except BaseException:
            for _, other, _, _ in background:
                _stop(other)
            raise
        finish(step, code, log_path, time.perf_counter() - start)
        join_background()
    run_joint()
    join_background()
    return statuses


def run_note(step: Step) -> str:
    """What the plan's printout says after a step's name about how it runs."""
    return (
        " (background)" if step.background else " (joint: one process with its group)" if step.joint else ""
    )


def _run_joint(group: list[tuple[int, Step]], out: str, finish, tqdm) -> None:
    """Run a joint group's steps in one process (`group[0][1].joint` builds its command) and finish each step as
    its line appears in the events file: {"output_dir", "status", "seconds"}, matched to the step whose outputs
    lie in that directory. A step with no line when the process ends failed with the process's exit code."""
    first = group[0][0]
    steps = [step for _, step in group]
    log_path = os.path.join(out, "logs", f"{first:02d}_{steps[0].name}{'_etc' if len(steps) > 1 else ''}.log")
    events = os.path.join(out, "logs", f"{first:02d}_events.jsonl")
    if os.path.exists(events):
        os.remove(events)
    shared = Step(name="+".join(s.name for s in steps), cmd=steps[0].joint(steps, events), outputs=[])
    print(f"  one process for {', '.join(s.name for s in steps)}:\n  $ {shared.command}", flush=True)
    by_dir = {os.path.dirname(os.path.abspath(s.outputs[0])): s for s in steps}
    waiting = dict(by_dir)
    start = time.perf_counter()
    read = 0

    def take_events() -> None:
        nonlocal read
        if not os.path.exists(events):
            return
        with open(events) as f:
            lines = f.read().splitlines()
        for line in lines[read:]:
            if not line.endswith("}"):  # being written: read it next time
                break
            event = json.loads(line)
            read += 1
            step = waiting.pop(event["output_dir"], None)
            if step is not None:
                finish(step, 0 if event["status"] == "done" else 1, log_path, float(event["seconds"]))

    bar = tqdm(
        desc=f"  {shared.name}", unit="it", dynamic_ncols=True, leave=False, file=sys.stdout, disable=None
    )
    proc = _start(shared, log_path)
    position = 0
    try:
        while proc.poll() is None:
            time.sleep(0.5)
            position = _update_bar(bar, log_path, position)
            take_events()
    except BaseException:
        _stop(proc)
        raise
    finally:
        bar.close()
    take_events()
    for step in list(waiting.values()):
        finish(step, proc.returncode or 1, log_path, time.perf_counter() - start)


def _run_foreground(step: Step, log_path: str, tqdm) -> int:
    """Run one step to its end -> exit code (in-process glue that raises counts as exit 1)."""
    # disable=None: a live bar on a terminal only; logs get the "done in" lines
    bar = tqdm(
        desc=f"  {step.name}", unit="it", dynamic_ncols=True, leave=False, file=sys.stdout, disable=None
    )
    try:
        if step.cmd is not None:
            return _watch(_start(step, log_path), log_path, bar)
        with open(log_path, "w") as log:
            log.write(step.command + "\n")
        step.fn()
        return 0
    except NotOursError:  # a step's output is a user's folder: refused with one line, nothing removed
        raise
    except Exception as e:  # a failed glue step or an unstartable command: report like a failed command
        with open(log_path, "a") as log:
            log.write(f"{type(e).__name__}: {e}\n")
        return 1
    finally:
        bar.close()


def _short(path: str) -> str:
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _tail(path: str, num_lines: int) -> str:
    with open(path, errors="replace") as f:
        lines = re.split(r"[\r\n]+", f.read())
    return "\n".join("    " + ln for ln in lines[-num_lines:] if ln.strip())
