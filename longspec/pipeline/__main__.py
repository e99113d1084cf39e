"""The main job end to end in one command: corpus -> stage 1/2/3 data -> three training stages -> export -> eval.

    python -m longspec.pipeline --preset cpu --out outputs/quickstart            # README quickstart (2-core CPU)
    python -m longspec.pipeline --preset smollm2 --out $OUT/e2e --data DATA_DIR  # launch/gpu_e2e.sh (one GPU)
    python -m longspec.pipeline --preset cpu --out DIR --dry-run                 # print the plan, run nothing
    python -m longspec.pipeline --preset cpu --out DIR stage1.train.max_steps=5 eval_max_samples=1  # Hydra overrides

Every step runs the real CLI a user would run (`python -m data_prep.stage1 ...`, `torchrun -m longspec.train ...`,
`python -m longspec.export ...`, `python -m longspec.eval ...`); the command is printed first and its output goes
to OUT/logs/NN_step.log. A finished step is recorded in OUT/e2e_manifest.json with its command: a rerun skips the
steps whose record matches and whose outputs exist, so an interrupted run continues where it stopped (and a changed
preset reruns from the first changed step on). At the end the evaluation's τ, tokens/s, speedup and lossless check
are printed and OUT/report.md (+ training_loss.png, the eval's plots) is written.

Presets are YAML files of one schema (configs/pipeline/<name>.yaml, schema
`longspec.pipeline.presets.PipelineConfig`), composed by Hydra like the training and eval configs. The positional
arguments after the flags are Hydra overrides of the preset's fields (`stage1.train.max_steps=5`, `tree_widths=[2,2]`,
`evals.0.methods=[ar]`); `--set FIELD=VALUE` is an alias that appends one to the same list. An unknown field or a bad
value is one line on stderr and exit status 2, before the first step: the preset's fields, the target, the locks of
the directories the steps write and each training / eval step's config (longspec/pipeline/preflight.py). Every
step's process dies with the pipeline, SIGKILL included (longspec/lifetime.py).

`cpu` drafts for the shipped code target (longspec/assets/code_target) with small stage lengths sized for
a 2-core machine; `smollm2` drafts for the real SmolLM2-135M-Instruct (its GGUF, de-quantized once) on one GPU, from
a bundle prepared beforehand (--data DIR: `launch/gpu_e2e.sh --prepare`, docs/DATA.md) and evaluates the held-out
instruct suite at 2K/4K/8K-token prompts.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from longspec.cli import USER_ERRORS, ArgumentParser, UserError, one_line, run_cli
from longspec.lifetime import RunLock
from longspec.ownership import check_output_dir, claim_output_dir
from longspec.pipeline.plan import plan
from longspec.pipeline.preflight import check_plan
from longspec.pipeline.presets import load_preset, preset_names
from longspec.pipeline.report import eval_rows, fmt, lossless_check, results_table, write_report
from longspec.pipeline.runner import RUN_RECORD_NAME, RunRecord, run_pipeline

PIPELINE_LOCK = "pipeline.lock"  # in OUT, held while the steps run
PIPELINE_KIND = "pipeline"  # OUT's ownership marker (longspec.ownership)

__all__ = ["main"]


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the pipeline waits, so the running step is stopped as on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _interrupt(signum, frame):
    raise _Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    previous = signal.getsignal(signal.SIGTERM)
    try:
        return run_cli(_main, argv)
    except KeyboardInterrupt as e:
        # The runner already stopped the running step (runner._watch): a traceback here said nothing more than
        # this line, and an interrupted run is the normal case a rerun continues.
        print(
            f"interrupted ({e or 'Ctrl-C'}): the running step was stopped; rerun the same command to continue",
            file=sys.stderr,
            flush=True,
        )
        return 128 + getattr(e, "signum", signal.SIGINT)
    finally:
        # Not ours past this point: a SIGTERM during the interpreter's exit raised in an atexit callback and
        # printed "Exception ignored ... KeyboardInterrupt" with a traceback.
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m longspec.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=preset_names(), default="cpu")
    parser.add_argument("--out", required=True, help="output directory (rerun with the same one to resume)")
    parser.add_argument(
        "--data", default=None, help="prepared data dir (corpus/, tokenizer/, tokens/): skips the corpus step"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="alias of one positional override (kept for scripts): --set stage1.train.max_steps=5",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="FIELD=VALUE",
        help="Hydra overrides of the preset's fields: stage1.train.max_steps=5 eval_max_samples=1 tree_widths=[2,2]",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan and what would be skipped")
    parser.add_argument("--force", action="store_true", help="rerun every step")
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="go on after a failed step; evaluate with the latest drafter there is (or baselines)",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="write the report from what exists, run nothing"
    )
    args = parser.parse_intermixed_args(argv)
    # --set values first, then the positional ones: one override list, one parser (Hydra's).
    preset = load_preset(args.preset, [*args.set, *args.overrides])
    if args.data is not None and not os.path.isdir(os.path.join(args.data, "corpus")):
        raise FileNotFoundError(
            f"--data {args.data!r} has no corpus/ (python -m data_prep.stdlib_corpus --out DIR/corpus)"
        )
    # Checked before the plan runs: the first step's errno line (or, --report-only, a missing report.md) named
    # neither the flag nor what to do.
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(f"--out {args.out!r} exists and is not a directory")
    # A folder the pipeline did not write (no ownership marker) is refused: its runs/, data/ and report.md would
    # be the user's files.
    check_output_dir(args.out, PIPELINE_KIND, what="--out")
    if args.report_only and not os.path.isfile(os.path.join(args.out, RUN_RECORD_NAME)):
        raise UserError(
            f"--report-only: {args.out!r} holds no pipeline run ({RUN_RECORD_NAME}); run the pipeline there first"
        )
    steps = plan(preset, args.out, data=args.data)
    out = os.path.abspath(args.out)
    print(f"longspec e2e, preset {preset.name}: {len(steps)} steps -> {out} (interpreter {sys.executable})")
    # SIGTERM (a job scheduler, a watchdog) stops the running step's process too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    start = time.perf_counter()
    if args.report_only:
        recorded = RunRecord(out).data["steps"]
        statuses = {s.name: recorded.get(s.name, {}).get("status", "not run") for s in steps}
    elif args.dry_run:
        run_pipeline(steps, out, dry_run=True, force=args.force, keep_going=args.keep_going)
        # What a run would refuse before its first step, said after the plan (a plan for a GPU machine is often
        # printed where its target is not).
        try:
            check_plan(preset, steps, locks=False)
        except USER_ERRORS as e:
            print(f"\nnote: a run of this plan here would stop before its first step: {one_line(e)}")
        return 0
    else:
        # Every step's config, the target and the run directories' locks, before anything is written: a bad eval
        # setting failed at the last step, after all the preparation and training.
        check_plan(preset, steps)
        # One pipeline per --out: a second one (a job requeued while the first still runs) removed the live
        # training run's directory before restarting it and overwrote the first's run record and exports.
        claim_output_dir(out, PIPELINE_KIND, what="--out")
        lock = RunLock(out, name=PIPELINE_LOCK, user="pipeline run", dir_option="--out", force_option=None)
        lock.acquire()
        try:
            statuses = run_pipeline(steps, out, force=args.force, keep_going=args.keep_going)
        finally:
            lock.release()
    wall_s = time.perf_counter() - start
    write_report(out, preset, steps, statuses, wall_s)
    rows = eval_rows(out, preset)
    run_record = RunRecord(out)
    print("\nsteps: " + ", ".join(f"{s.name} {statuses.get(s.name, '?')} {fmt(run_record.seconds(s.name), '.0f')} s"
                                  for s in steps))  # fmt: skip
    print("\n" + results_table(rows) if rows else "\nno evaluation results")
    print(f"\nreport: {os.path.join(out, 'report.md')} ({wall_s:.0f} s this invocation)")
    return 0 if lossless_check(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
