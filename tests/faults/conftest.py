"""Fixtures of the fault-injection suite (its helpers are in fault_helpers.py)."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_thread(one_thread):
    """Tiny shapes only: one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny target with the byte tokenizer (a file may define its own)."""
    from longspec.testing import save_tiny_target

    return save_tiny_target("llama", tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A training run with one complete checkpoint, as export reads it."""
    from test_export_faults import _write_checkpoint

    run = tmp_path_factory.mktemp("runs") / "stage1"
    _write_checkpoint(run, 2)
    return run
