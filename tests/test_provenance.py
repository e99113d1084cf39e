"""The commit stamped into reports: LONGSPEC_COMMIT for a tree without history, else git."""

from __future__ import annotations

import re
import shutil

import pytest

from longspec.provenance import git_commit


def test_stamped_commit_wins(monkeypatch):
    monkeypatch.setenv("LONGSPEC_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    assert git_commit() == "0123456"
    assert git_commit(short=False) == "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("LONGSPEC_COMMIT", "v1.2-build")
    assert git_commit() == "v1.2-build"


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_git_checkout_commit(monkeypatch):
    monkeypatch.delenv("LONGSPEC_COMMIT", raising=False)
    commit = git_commit(dirty=False)
    # a checkout (CI, dev): a hex hash; an exported tree without .git: "unknown"
    assert commit == "unknown" or re.fullmatch(r"[0-9a-f]{7,40}", commit)
    full = git_commit(short=False, dirty=False)
    assert full == "unknown" or re.fullmatch(r"[0-9a-f]{40}", full)
