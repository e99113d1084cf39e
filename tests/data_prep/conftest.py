import pytest

from longspec.testing import build_byte_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """The byte tokenizer (one token a byte, a chat template): bucket lengths are byte counts."""
    return build_byte_tokenizer()
