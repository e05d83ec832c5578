"""The repository itself: what is tracked, and that the tests leave the source tree as they found it
(tests/conftest.py checks the second after every test module)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> bytes:
    try:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if r.returncode != 0:
        pytest.skip(f"not a git checkout: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout


def test_tracked_names_are_printable_ascii():
    """A garbage name (a fuzz example's output path, committed by accident) breaks checkouts on other
    file systems and hides in `ls`; every tracked path must be plain printable ASCII."""
    names = [n for n in _git("ls-files", "-z").split(b"\0") if n]
    assert names, "git ls-files listed nothing"
    bad = [n for n in names if not all(0x20 <= c < 0x7f for c in n)]
    assert bad == [], f"tracked paths with non-printable or non-ASCII names: {bad}; git rm them"


def test_no_packages_or_binaries_of_other_projects_are_tracked():
    """Wheels and archives (a pip download in the tree, a build's sdist) are not the project's files."""
    tracked = _git("ls-files", "-z").decode().split("\0")
    stray = [n for n in tracked if n.endswith((".whl", ".tar.gz", ".zip", ".egg"))]
    assert not stray, f"tracked packages: {stray}; git rm them"
