"""Tiny GGUF files written once per session with gguf-py's writer (F32 unless a test asks for F16)."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")

from longspec.testing import save_tiny_gguf  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """family -> (path of its .gguf, the HF model it was written from)."""
    root = tmp_path_factory.mktemp("gguf")
    cache = {}

    def make(family: str, dtype: str = "float32"):
        if (family, dtype) not in cache:
            path = root / f"{family}-{dtype}.gguf"
            cache[family, dtype] = (path, save_tiny_gguf(family, path, dtype=dtype))
        return cache[family, dtype]

    return make
