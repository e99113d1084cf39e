#!/usr/bin/env bash
# bash launch/quickstart.sh [OUT_DIR]          (README quickstart, command 1; default OUT_DIR outputs/quickstart)
# On a fresh Linux machine (a 2-core CPU is enough, no GPU, no downloads besides PyPI packages):
#   1. creates .venv if missing and installs exactly as the README's CPU install (pinned CPU torch first);
#   2. runs the whole main job: stdlib corpus -> stage 1/2/3 data -> drafter training through the three stages
#      under DeepSpeed (2 CPU processes) -> export -> speculative vs vanilla decoding on held-out code.
# Prints τ, tokens/s, speedup and the lossless check; the report is OUT_DIR/report.md (+ PNGs). Rerunning continues
# an interrupted run (finished steps are skipped). Extra arguments go to `python -m longspec.pipeline`, e.g. --dry-run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/quickstart}
shift || true
start=$(date +%s)
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
# Installed once per version of the requirements (a stamp of pyproject.toml + constraints in .venv).
stamp=$(cat pyproject.toml constraints-cpu.txt | sha256sum | cut -c1-16)
if [ "$(cat .venv/.quickstart-install 2>/dev/null)" != "$stamp" ]; then
    python -m pip install -q --upgrade pip
    pip install -q -c constraints-cpu.txt torch
    pip install -q -c constraints-cpu.txt -e ".[dev]"
    echo "$stamp" > .venv/.quickstart-install
fi
echo "install: $(( $(date +%s) - start )) s"
export DS_ACCELERATOR=cpu WANDB_MODE=${WANDB_MODE:-disabled}
python -m longspec.pipeline --preset cpu --out "$OUT" "$@"
echo "quickstart total: $(( $(date +%s) - start )) s"
