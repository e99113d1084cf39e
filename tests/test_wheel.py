"""A wheel install composes the shipped configs: build the wheel from a copy of the sources (the top-level configs/
ships as longspec/configs), extract it (nothing is installed) and load a training and an eval config with only the
extracted package on the path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from longspec.config import config_root

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "longspec", "data_prep", "configs")


def compose_both(tmp: str):
    """A training and an eval config of the tiny target (no package to install, no download) and the cpu pipeline
    preset (whose validation finds the shipped code target through pkg://longspec/...), as plain dicts."""
    import dataclasses

    from longspec.eval.config import load_eval_config
    from longspec.pipeline.presets import load_preset
    from longspec.train.config import load_config

    target = ["target=tiny_llama", f"target.path={tmp}"]
    train = load_config([*target, "stage=tiny_stage1", f"data.path={tmp}", f"output_dir={tmp}/run"])
    ev = load_eval_config([*target, "drafter.init=random", "data.name=lcc", "method=[longspec,ar]"])
    pipeline = load_preset("cpu", ["stage1.train.max_steps=3"])
    return {
        "train": dataclasses.asdict(train),
        "eval": dataclasses.asdict(ev),
        "pipeline": dataclasses.asdict(pipeline),
    }


# Runs with only the extracted wheel importable (this file is exec'd by path, so nothing of the checkout leaks in).
PROBE = """
import json, runpy, sys
import longspec
from longspec.config import config_root

compose_both = runpy.run_path(sys.argv[1])["compose_both"]
print(json.dumps({"package": longspec.__file__, "config_dir": config_root(), **compose_both(sys.argv[2])}))
"""


@pytest.mark.slow
def test_wheel_ships_the_configs_and_composes_them(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    junk = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in SOURCES:  # a copy, so the build writes its build/ and egg-info there, not into the checkout
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=junk)
        else:
            shutil.copy(ROOT / name, src / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("longspec-*.whl")

    with zipfile.ZipFile(wheel) as zf:
        shipped = {
            n.removeprefix("longspec/configs/") for n in zf.namelist() if n.startswith("longspec/configs/")
        }
        site = tmp_path / "site"
        zf.extractall(site)
    expected = {p.relative_to(config_root()).as_posix() for p in Path(config_root()).rglob("*.yaml")}
    assert {
        "train.yaml",
        "eval.yaml",
        "target/tiny_llama.yaml",
        "stage/tiny_stage1.yaml",
        "pipeline/cpu.yaml",
    } <= expected
    assert shipped == expected

    env = {k: v for k, v in os.environ.items() if k not in ("LONGSPEC_CONFIG_DIR", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run(
        [sys.executable, "-c", PROBE, __file__, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(got.pop("package")).is_relative_to(site)
    assert Path(got.pop("config_dir")) == site / "longspec" / "configs"
    # The wheel composes exactly what the checkout composes.
    assert got == json.loads(json.dumps(compose_both(str(tmp_path))))
    assert got["train"]["stage"]["name"] == "tiny_stage1" and got["eval"]["method"] == ["longspec", "ar"]
    assert got["pipeline"]["name"] == "cpu" and got["pipeline"]["stage1"]["train"]["max_steps"] == 3
