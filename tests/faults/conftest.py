"""Fixtures of the fault-injection suite (its helpers are in fault_helpers.py)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny shapes: intra-op threads only add contention on a shared small machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
