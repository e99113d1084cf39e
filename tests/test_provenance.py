"""The commit stamped into reports: LONGSPEC_COMMIT for a tree without history, else git."""

from __future__ import annotations

import re
import shutil

import pytest

from longspec.provenance import git_commit, run_info


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


def test_run_info_names_command_commit_and_device(monkeypatch):
    monkeypatch.setenv("LONGSPEC_COMMIT", "abc1234")
    monkeypatch.setattr("sys.argv", ["benchmarks/x.py", "--ignored"])
    info = run_info(device="cpu", argv=["--contexts", "64"])
    assert info["command"] == "python benchmarks/x.py --contexts 64"
    assert info["commit"] == "abc1234" and info["device"] == "cpu"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", info["date"])
    assert run_info(device="cpu")["command"] == "python benchmarks/x.py --ignored"
