"""Fixtures of the fault-injection suite (its helpers are in fault_helpers.py)."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_thread(one_thread):
    """Tiny shapes only: one intra-op thread (tests/conftest.py)."""
