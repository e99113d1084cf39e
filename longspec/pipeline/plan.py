"""The pipeline's plan: a preset -> the ordered steps (the exact CLI a user would run, or a small in-process glue
call), and the training-stage steps the ablations reuse. Nothing is executed here."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from data_prep.common import prep_lock_path
from data_prep.prefix_prompts import write_prefix_prompts
from longspec.atomic import write_text_atomic
from longspec.config import check
from longspec.data.manifest import manifest_path
from longspec.export import default_out_dir, export_marker
from longspec.lifetime import LOCK_NAME, refuse_if_held
from longspec.ownership import NotOursError, remove_owned, write_marker
from longspec.pipeline.presets import PipelineConfig, StagePlan, target_overrides
from longspec.pipeline.resume import restart_on_changed_inputs
from longspec.train.checkpoint import RUN_KIND, checkpoints_root, done_marker, latest_checkpoint
from longspec.train.config import load_config

__all__ = ["Step", "eval_data_overrides", "eval_runs_command", "plan", "stage_steps"]

EVAL_MODULE = ["-m", "longspec.eval"]


@dataclass(kw_only=True)
class Step:
    """One pipeline step: a CLI run as a subprocess, or a small piece of in-process glue."""

    name: str
    outputs: list[str]  # every path must exist for the step to count as done
    cmd: list[str] | None = None
    fn: Callable[[], None] | None = None  # in-process glue (writing prompt / bucket files)
    describe: str = ""  # what `fn` does, shown in place of a command (and part of its run-record key)
    env: dict[str, str] = field(default_factory=dict)
    required: bool = True  # a failed optional step is reported; the pipeline goes on
    background: bool = False  # run concurrently with the next foreground step (joined when that one ends)
    # Consecutive steps with the same `joint` run in one process: joint(steps, events_path) -> its command, which
    # appends one JSON line per finished step to events_path ({"output_dir", "status", "seconds"}).
    joint: Callable[[list[Step], str], list[str]] | None = None
    needs: list[str] = field(default_factory=list)  # inputs made by earlier steps
    # --keep-going: used in order when `needs` are missing
    alternatives: list[Step] = field(default_factory=list)
    # lock files its process holds while it writes (longspec.lifetime): a live one refuses the run up front
    locks: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        """The run-record key and the printed line: the exact command (interpreter shown as `python`)."""
        if self.cmd is None:
            return f"[in-process] {self.describe}"
        shown = ["python" if arg == sys.executable else arg for arg in self.cmd]
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(shown)


def plan(preset: PipelineConfig, out: str, *, data: str | None = None) -> list[Step]:
    """The ordered steps of one run (nothing is executed here)."""
    py = sys.executable
    out = os.path.abspath(out)
    data = os.path.abspath(data) if data else None
    corpus = os.path.join(data, "corpus") if data else os.path.join(out, "corpus")
    train_jsonl = os.path.join(corpus, "train.jsonl")
    steps: list[Step] = []
    if data is None and preset.uses_corpus:
        check(
            preset.lcc_max_context_chars >= 1,
            f"lcc_max_context_chars must be >= 1 when the corpus is built (no --data), got {preset.lcc_max_context_chars}",
        )
        steps.append(
            Step(
                name="corpus",
                cmd=[py, "-m", "data_prep.stdlib_corpus", "--out", corpus,
                     "--lcc-max-context-chars", str(preset.lcc_max_context_chars)],
                outputs=[os.path.join(corpus, name) for name in
                         ("manifest.json", "train.jsonl", "heldout.jsonl", "heldout_lcc.jsonl")],
            )
        )  # fmt: skip
    convert = None
    if preset.target_path is not None:
        target = tokenizer = preset.target_dir()
    elif preset.target_gguf is not None:
        # De-quantize once: every later step loads an HF directory instead of de-quantizing again.
        stem = os.path.basename(preset.target_gguf).removesuffix(".gguf")
        target = tokenizer = os.path.join(out, "target", stem)  # the run name comes from the directory name
        convert = Step(
            name="convert_target",
            cmd=[py, "-m", "longspec.convert_gguf", preset.target_gguf, target, "--dtype", preset.target_dtype,
                 "--overwrite"],
            outputs=[os.path.join(target, "config.json")],
        )  # fmt: skip
        if not preset.cpu:
            # On a GPU machine the data is tokenized with the GGUF's own tokenizer while the target converts
            # (both CPU-bound: together they take the time of the longer one). The tokenizer fingerprint is
            # canonical content, so data tokenized from the GGUF matches the converted directory's tokenizer.
            tokenizer = preset.target_gguf
    else:  # the target group's own model (a hub id, a directory or a GGUF), named as the group names it
        source = _target_group(preset.target_config).source()
        target = tokenizer = source.gguf_path or source.repo

    data_dir = os.path.join(out, "data")
    s1, s2, s3 = (os.path.join(data_dir, f"stage{i}") for i in (1, 2, 3))
    prompts = (
        os.path.join(data, preset.stage3_prompts)
        if data and preset.stage3_prompts
        else os.path.join(data_dir, "stage3_prompts.jsonl")
    )
    stage1_sources = [_input(data, preset.stage1_source)] if preset.stage1_source else [train_jsonl]
    stage2_sources = [_input(data, s) for s in preset.stage2_sources] or [train_jsonl]
    regenerated = os.path.join(data_dir, "stage3_regenerated.jsonl")
    common = ["--tokenizer", tokenizer, "--overwrite", "--no-progress"]
    cmd = [py, "-m", "data_prep.stage1", *_sources(stage1_sources), "--out", s1,
           "--seq-len", str(_seq_len(preset.stage1)), *common]  # fmt: skip
    if preset.stage1_max_rows:
        cmd += ["--max-rows", str(preset.stage1_max_rows)]
    data_steps = [Step(name="data_stage1", cmd=cmd, outputs=[manifest_path(s1)], locks=[prep_lock_path(s1)])]
    cmd = [py, "-m", "data_prep.stage2", *_sources(stage2_sources), "--out", s2, "--seq-len",
           str(_seq_len(preset.stage2)), "--min-tokens", str(preset.stage2_min_tokens), *common]  # fmt: skip
    if preset.stage2_max_rows:
        cmd += ["--max-rows", str(preset.stage2_max_rows)]
    data_steps.append(
        Step(name="data_stage2", cmd=cmd, outputs=[manifest_path(s2)], locks=[prep_lock_path(s2)])
    )
    if convert is not None and tokenizer != target:  # joined when the conversion ends
        for step in data_steps:
            step.background = True
        steps += [*data_steps, convert]
    else:
        steps += ([convert] if convert else []) + data_steps
    regenerate = None
    if preset.stage3_source:  # SFT rows given: the target's own answers are not generated
        stage3_rows, unfinished = _input(data, preset.stage3_source), []
    else:
        stage3_rows, unfinished = regenerated, ["--keep-unfinished"]  # responses cut at regen_max_new_tokens
        if not (data and preset.stage3_prompts):
            steps.append(
                Step(
                    name="stage3_prompts",
                    fn=lambda: write_prefix_prompts(
                        train_jsonl, prompts, num_prompts=preset.num_prompts, max_chars=preset.prompt_chars
                    ),
                    describe=f"write_prefix_prompts({train_jsonl}, {prompts}, num_prompts={preset.num_prompts}, "
                    f"max_chars={preset.prompt_chars})",
                    outputs=[prompts],
                )
            )
        regen_cmd = [py, "-m", "data_prep.stage3_regenerate", "--target", target, "--source", prompts,
                     "--out", regenerated, "--template", preset.stage3_template,
                     "--max-new-tokens", str(preset.regen_max_new_tokens), "--max-rows", str(preset.num_prompts),
                     "--batch-size", str(preset.regen_batch_size), "--no-progress"]  # fmt: skip
        regenerate = Step(
            name="stage3_regenerate",
            cmd=regen_cmd,
            outputs=[regenerated],
            locks=[prep_lock_path(regenerated, file=True)],
        )
        regenerate.fn = _prepare_partial_output(regenerated, regenerate.command)
    data_stage3 = Step(
        name="data_stage3",
        cmd=[py, "-m", "data_prep.stage3_sft", "--source", stage3_rows, "--out", s3,
             "--template", preset.stage3_template,
             "--max-len", str(_seq_len(preset.stage3)), *unfinished, *common],
        outputs=[manifest_path(s3)],
        locks=[prep_lock_path(s3)],
    )  # fmt: skip

    overrides = target_overrides(preset, target)
    training: list[list[Step]] = []
    previous_export = None
    for index, (stage, stage_data) in enumerate(
        ((preset.stage1, s1), (preset.stage2, s2), (preset.stage3, s3)), 1
    ):
        run_dir = os.path.join(out, "runs", f"stage{index}")
        # Stage 1 chooses the draft vocabulary from the drafter's own training data; later stages keep init_from's.
        vocab = (
            []
            if preset.draft_vocab_size is None or previous_export
            else [
                f"drafter.draft_vocab_size={preset.draft_vocab_size}",
                f"drafter.draft_vocab_data=[{s1},{s3}]",
            ]
        )
        training.append(stage_steps(
            preset, f"stage{index}", stage, target_overrides=[*overrides, *vocab], data_path=stage_data,
            run_dir=run_dir, init_from=previous_export,
        ))  # fmt: skip
        previous_export = default_out_dir(run_dir)
    prepare = [regenerate] if regenerate else []
    if preset.cpu or preset.draft_vocab_size is not None:
        # Two cores: every step gets them all, one after another. A draft vocabulary is chosen in stage 1 from
        # the stage-3 data too, so that data comes first.
        steps += [*prepare, data_stage3, *training[0], *training[1], *training[2]]
    else:
        # A GPU has room for both: the target writes the stage-3 responses while stage 1 trains, and stage 3 is
        # tokenized (CPU) while stage 2 trains. Each background step is joined when that training step ends.
        for step in (*prepare, data_stage3):
            step.background = True
        steps += [*prepare, *training[0], data_stage3, *training[1], *training[2]]

    if preset.eval_suite and data is None:
        raise ValueError(f"preset {preset.name!r} evaluates a prepared suite: pass --data DIR")

    def data_overrides_of(ev) -> list[str]:
        if preset.eval_suite:
            return eval_data_overrides(
                preset, [os.path.join(data, name) for name in ev.suite or preset.eval_suite]
            )
        return eval_data_overrides(preset, [os.path.join(corpus, "heldout_lcc.jsonl")])

    exports = [default_out_dir(os.path.join(out, "runs", f"stage{i}")) for i in (3, 2, 1)]
    given = os.path.abspath(preset.drafter_path) if preset.drafter_path else None
    for ev in preset.evals:
        eval_dir = os.path.join(out, f"eval_{ev.name}" if ev.name else "eval")

        data_overrides = data_overrides_of(ev)

        def eval_step(
            drafter: str | None, ev=ev, eval_dir=eval_dir, data_overrides=data_overrides
        ) -> Step | None:
            methods = [m for m in ev.methods if drafter is not None or m != "longspec"]
            if not methods:
                return None
            return Step(
                name=f"eval_{ev.name}" if ev.name else "eval",
                cmd=[py, *EVAL_MODULE, *overrides,
                     *([f"drafter.path={drafter}"] if drafter and "longspec" in methods else []),
                     *data_overrides, f"method=[{','.join(methods)}]", f"temperature={ev.temperature}",
                     f"max_new_tokens={preset.eval_max_new_tokens}", f"max_samples={ev.max_samples or preset.eval_max_samples}",
                     *([f"tree_widths=[{','.join(map(str, preset.tree_widths))}]"] if preset.tree_widths else []),
                     f"output_dir={eval_dir}",
                     *ev.extra],
                outputs=[os.path.join(eval_dir, "results.json"), os.path.join(eval_dir, "report.md")],
                needs=[os.path.join(target, "config.json")] + ([drafter] if drafter else []),
                required=ev.required,
                joint=eval_runs_command,
            )  # fmt: skip

        step = eval_step(given or exports[0])
        # --keep-going: an earlier stage's drafter when a later stage failed, else the baselines alone
        fallbacks = [] if given else exports[1:]
        step.alternatives = [alt for alt in (*map(eval_step, fallbacks), eval_step(None)) if alt is not None]
        steps.append(step)
    if given:  # a drafter to evaluate, not to train: no data or training step
        steps = [s for s in steps if s.name in ("corpus", "convert_target") or s.name.startswith("eval")]
    return steps


def eval_data_overrides(preset: PipelineConfig, sources: list[str]) -> list[str]:
    """The eval's data overrides for `sources` as the preset evaluates them: a prepared suite's rows are already
    cut to their context (no length filter, no margin, the suite's context length); held-out files are cut by
    the eval (`eval_min_prompt_tokens`). Also used by benchmarks/ablations/."""
    if preset.eval_suite:
        return [f"data.name=[{','.join(sources)}]", "data.min_prompt_tokens=0", "data.context_margin=0",
                *([f"data.context_len={preset.eval_context_len}"] if preset.eval_context_len else [])]  # fmt: skip
    (source,) = sources
    return [f"data.path={source}", f"data.min_prompt_tokens={preset.eval_min_prompt_tokens}"]


def eval_runs_command(steps: list[Step], events: str) -> list[str]:
    """The evaluation steps as one `python -m longspec.eval.runs` process: each step's own eval overrides become
    one --run. The models, graphs and round costs are then loaded / built once for all of them, not once per
    evaluation."""
    cmd = [sys.executable, "-m", "longspec.eval.runs", "--events", events]
    for step in steps:
        head = step.cmd[1 : 1 + len(EVAL_MODULE)]
        if head != EVAL_MODULE:
            raise ValueError(f"step {step.name} is not a `python -m longspec.eval` run: {step.command}")
        cmd += ["--run", *step.cmd[1 + len(EVAL_MODULE) :]]
    return cmd


def stage_steps(
    preset: PipelineConfig,
    name: str,
    stage: StagePlan,
    *,
    target_overrides: list[str],
    data_path: str,
    run_dir: str,
    init_from: str | None = None,
) -> list[Step]:
    """train_<name> (torchrun -m longspec.train) + export_<name> (python -m longspec.export RUN_DIR RUN_DIR/export).
    Also used by benchmarks/ablations/."""
    py = sys.executable
    overrides = preset.train_overrides(
        stage, target=target_overrides, data_path=data_path, run_dir=run_dir, init_from=init_from
    )
    train = Step(
        name=f"train_{name}",
        cmd=[py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(preset.num_procs),
             "-m", "longspec.train", *overrides],
        env={"DS_ACCELERATOR": "cpu"} if preset.cpu else {},
        # A fixed schedule is done when its last checkpoint is complete; any other run (epochs, or the stage YAML's
        # max_steps) when the trainer exited 0 (the run record) and left its checkpoints.
        outputs=[done_marker(run_dir, stage.max_steps) if stage.max_steps else checkpoints_root(run_dir)],
        needs=[manifest_path(data_path), *([init_from] if init_from else [])],
        locks=[os.path.join(run_dir, LOCK_NAME)],
    )  # fmt: skip
    train.fn = _prepare_run_dir(run_dir, train.command, stage.resumable, overrides)
    export = Step(
        name=f"export_{name}",
        cmd=[py, "-m", "longspec.export", run_dir, default_out_dir(run_dir), "--overwrite"],
        outputs=[export_marker(default_out_dir(run_dir))],
        needs=[checkpoints_root(run_dir)],
    )
    return [train, export]


def _input(data: str | None, name: str) -> str:
    """A prepared input named by the preset: relative to --data when there is one."""
    return os.path.join(data, name) if data else name


def _sources(sources: list[str]) -> list[str]:
    return [arg for source in sources for arg in ("--source", source)]


def _target_group(name: str):
    """The TargetConfig of configs/target/<name>.yaml (as the training config composes it)."""
    return load_config([f"target={name}", "data.path=unused"]).target


def _seq_len(stage: StagePlan) -> int:
    """The row length the stage's data is prepared for: the stage's train.stage.seq_len, else its stage YAML's."""
    seq_len = stage.setting("stage.seq_len")
    if seq_len is not None:
        return seq_len
    return load_config([f"stage={stage.config}", "data.path=unused"]).stage.seq_len


# Beside a step's partial output: the command that wrote it. A rerun continues that output only if it runs the
# same command; a changed one (another preset, other overrides) starts from scratch.
COMMAND_MARKER = ".pipeline_command"


def _same_command(marker: str, command: str) -> bool:
    if not os.path.isfile(marker):
        return False
    with open(marker) as f:
        return f.read() == command


def _prepare_run_dir(run_dir: str, command: str, resumable: bool, overrides: list[str]) -> Callable[[], None]:
    """Before a training step: a resumable stage keeps a run dir that its own command left with a complete
    checkpoint trained on the same inputs (the trainer resumes from the latest: a run stopped by a job's time
    limit loses at most save_every steps); otherwise the dir is removed and the stage starts from scratch (data
    re-prepared with other rows under the same command: `resume.restart_on_changed_inputs` says so). Only a run
    dir a trainer or the pipeline marked as a training run is removed (longspec.ownership), never one reached
    through a symlink below the pipeline's OUT (run dirs are OUT/runs/NAME)."""
    marker = os.path.join(run_dir, COMMAND_MARKER)

    def prepare() -> None:
        # A live run (its lock held: a killed pipeline's orphan, another launch) is neither continued nor removed
        refuse_if_held(os.path.join(run_dir, LOCK_NAME), "trainer")
        if (
            resumable
            and _same_command(marker, command)
            and latest_checkpoint(run_dir) is not None
            and not restart_on_changed_inputs(run_dir, overrides)
        ):
            return
        out = os.path.dirname(os.path.dirname(os.path.abspath(run_dir)))
        remove_owned(run_dir, RUN_KIND, root=out, what="run directory")
        os.makedirs(run_dir)
        write_marker(run_dir, RUN_KIND, command=command)
        write_text_atomic(marker, command)

    return prepare


def _prepare_partial_output(path: str, command: str) -> Callable[[], None]:
    """Before stage3_regenerate, which appends to its output and skips the prompts already answered there: a
    partial output of the same command is continued, any other removed (old rows must not mix in)."""
    marker = f"{path}{COMMAND_MARKER}"

    def prepare() -> None:
        refuse_if_held(prep_lock_path(path, file=True), "data prep")  # a live one's output is not removed
        if _same_command(marker, command):
            return
        if os.path.lexists(path):
            if not os.path.isfile(marker) or os.path.islink(
                path
            ):  # no marker of ours beside it: a user's file
                raise NotOursError(
                    f"{path!r} was not written by the pipeline: move it away or choose another --out"
                )
            os.remove(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_text_atomic(marker, command)

    return prepare
