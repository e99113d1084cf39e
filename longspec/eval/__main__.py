"""`python -m longspec.eval`: one evaluation run, every method on every sample, then results.json, report.md and
plots (`longspec.eval.harness.run_eval`).

    python -m longspec.eval target=llama31_8b drafter.path=DIR data.name=[gov_report,lcc] \
        method=[longspec,vanilla_fa,pld] max_samples=20 output_dir=outputs/eval/llama31_8b

Several runs that share a target: `python -m longspec.eval.runs` (one process, the models loaded once).
"""

from __future__ import annotations

import logging
import sys

from longspec.cli import run_cli
from longspec.eval.config import load_eval_config, split_config_name
from longspec.eval.harness import log_summary, run_eval

__all__ = ["main", "run_eval"]


def _main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config_name, args = split_config_name(argv)
    cfg = load_eval_config(args, config_name=config_name)
    log_summary(run_eval(cfg), cfg.output_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The CLI: exit status 0, or 2 with one `error:` line on stderr for a user error (a bad override, a missing
    path, a source with no usable sample); `--debug` or HYDRA_FULL_ERROR=1 for the traceback."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
