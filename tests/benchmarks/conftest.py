"""The tests of the benchmark scripts (benchmarks/, ablations included): each loads its script through the
`load_benchmark` fixture of tests/conftest.py and runs it at tiny sizes."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_thread(one_thread):
    """Tiny shapes only: one intra-op thread (tests/conftest.py)."""
