import importlib.util
import os
import sys
from pathlib import Path

# Tests are offline and quiet by default; set before any library reads them.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton decides interpreter vs compiled when a kernel is *defined* (the first import of a kernel module), so
# without a GPU the CPU interpreter must be requested before any test module imports Triton or a kernel, in
# whatever order pytest collects them (longspec itself imports kernel modules lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords or "multi_gpu" in item.keywords:
            item.add_marker(skip)


def _load_benchmark(name: str):
    """benchmarks/<name>.py (e.g. "round_latency", "ablations/anchor_offset") as a fresh module: the benchmarks are
    scripts, not a package. Registered in sys.modules under its own name, as an imported module would be (dataclasses
    look their module up there); an ablation script puts its own directory on sys.path for its sibling common.py."""
    path = BENCHMARKS / f"{name}.py"
    module_name = "benchmark_" + name.replace("/", "_")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_benchmark():
    """load_benchmark(name) -> the module of benchmarks/<name>.py; the one loader every test of a script uses."""
    return _load_benchmark


@pytest.fixture(autouse=True)
def _round_cost_cache(tmp_path_factory, monkeypatch):
    """Each test its own round-cost cache folder (`longspec.infer.policy.cost_cache`): no test reads a table
    another test (or a user's run) measured, or wrote with a stubbed timer."""
    monkeypatch.setenv("LONGSPEC_CACHE_DIR", str(tmp_path_factory.mktemp("cost_cache")))


@pytest.fixture(scope="session")
def one_thread():
    """Tiny shapes: intra-op threads only add contention on the shared 2-core machines (~10x slower). A directory
    whose tests are all tiny opts in with an autouse fixture that requests this one."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
