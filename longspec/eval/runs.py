"""`python -m longspec.eval.runs`: several evaluation runs one after another in one process, the models loaded
once (`longspec.eval.session.EvalSession`: a run that asks for the previous run's target reuses it, its drafter,
and the engine's static steps / CUDA graphs and measured round costs).

    python -m longspec.eval.runs target=llama31_8b drafter.path=DIR data.name=[gov_report,qmsum] \
        --run method=[longspec,ar,vanilla_fa] cuda_graphs=true output_dir=outputs/eval/t0 \
        --run method=[longspec,ar] temperature=1.0 cuda_graphs=true output_dir=outputs/eval/t1

The overrides before the first --run apply to every run; each --run adds its own (later ones win). Every run's
config is composed and validated before the first one starts, so a bad override costs no model load (exit 2, one
line). A run that fails is logged with its traceback and the next one starts, from freshly loaded models; the
exit status is 1 if any run failed. Each run writes its output_dir as `python -m longspec.eval` would
(results.json, report.md, plots), and `--events FILE` gets one JSON line per finished run, as it finishes
(`{"run", "output_dir", "status", "seconds"}`, status done or failed): the pipeline records each evaluation from
it while the others still run.

Why one process: as separate processes, each evaluation of a suite starts, loads the models, captures the graphs
and measures the round costs again; in one process only the first does.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from longspec.cli import ArgumentParser, UserError, run_cli
from longspec.eval.config import EvalConfig, load_eval_config, split_config_name
from longspec.eval.harness import log_summary, run_eval
from longspec.eval.session import EvalSession

__all__ = ["main", "parse_runs"]

logger = logging.getLogger("longspec.eval")

RUN_FLAG = "--run"


def parse_runs(argv: list[str]) -> tuple[list[EvalConfig], str | None]:
    """The command line -> (each run's validated config, the --events path or None)."""
    if RUN_FLAG not in argv:
        raise UserError(
            f"python -m longspec.eval.runs: no {RUN_FLAG}: give each run as `{RUN_FLAG} OVERRIDE ...`"
        )
    first = argv.index(RUN_FLAG)
    head, rest = argv[:first], argv[first:]
    config_name, head = split_config_name(head)
    parser = ArgumentParser(prog="python -m longspec.eval.runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", default=None, help="append one JSON line per finished run to this file")
    parser.add_argument("common", nargs="*", metavar="OVERRIDE", help="overrides of every run")
    options = parser.parse_intermixed_args(head)
    runs: list[list[str]] = []
    for arg in rest:
        if arg == RUN_FLAG:
            runs.append([])
        else:
            runs[-1].append(arg)
    configs = []
    for index, overrides in enumerate(runs, 1):
        try:
            configs.append(load_eval_config([*options.common, *overrides], config_name=config_name))
        except Exception as e:  # the run's number in front of the composer's one-line message
            raise type(e)(f"run {index} ({' '.join(overrides) or 'no overrides'}): {e}") from e
    dirs = [os.path.abspath(c.output_dir) for c in configs]
    shared = sorted({d for d in dirs if dirs.count(d) > 1})
    if shared:
        raise UserError(f"runs must write different output_dir; shared: {', '.join(shared)}")
    return configs, options.events


def _main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    configs, events = parse_runs(argv)
    session = EvalSession()
    failed = []
    for index, cfg in enumerate(configs, 1):
        logger.info("run %d/%d -> %s", index, len(configs), cfg.output_dir)
        start = time.perf_counter()
        try:
            log_summary(run_eval(cfg, session), cfg.output_dir)
            status = "done"
        except Exception:  # the next run may still work (another dtype, another method): log it, go on
            logger.exception("run %d/%d (%s) failed", index, len(configs), cfg.output_dir)
            failed.append(index)
            status = "failed"
            session.release()  # the next run starts from freshly loaded models
        seconds = time.perf_counter() - start
        logger.info("run %d/%d %s in %.1f s (targets loaded so far: %d)", index, len(configs), status, seconds,
                    session.loads)  # fmt: skip
        if events:
            with open(events, "a") as f:  # one line per run, flushed at once: a reader polls it
                f.write(json.dumps({"run": index, "output_dir": os.path.abspath(cfg.output_dir),
                                    "status": status, "seconds": round(seconds, 1)}) + "\n")  # fmt: skip
    if failed:
        logger.error("runs failed: %s of %d", ", ".join(map(str, failed)), len(configs))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """The CLI: exit status 0 when every run wrote its results, 1 when one failed (the others still ran), 2 with
    one `error:` line for a bad command line or config (nothing ran)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
