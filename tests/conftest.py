import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# tests import their shared fixtures as `from tests.helpers import ...`
sys.path.insert(0, str(ROOT))


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


# Test folders whose modules import graph_passes, and so onnx-graphsurgeon, when they are
# collected. A machine without it (the borrowed GPU machine has none) would stop at
# collection, even for `pytest -m gpu`; there these folders are not collected, and the run
# says so in its header and summary. tests/test_gpu_collection.py keeps this list true.
NEEDS_GRAPHSURGEON = ("graph_passes", "export")
NOT_COLLECTED = (f"not collected: tests/{', tests/'.join(NEEDS_GRAPHSURGEON)} (onnx-graphsurgeon is not importable; "
                 "pip install onnx-graphsurgeon)")
GRAPHSURGEON_MISSING = not _importable("onnx_graphsurgeon")
collect_ignore = list(NEEDS_GRAPHSURGEON) if GRAPHSURGEON_MISSING else []


def pytest_report_header(config):
    return [NOT_COLLECTED] if GRAPHSURGEON_MISSING else []


def pytest_terminal_summary(terminalreporter):
    if GRAPHSURGEON_MISSING:
        terminalreporter.write_line(NOT_COLLECTED)


# Tests write under temporary directories only. A fuzz example once left three garbage-named
# outputs at the repository root, and they were committed with the next `git add`. So after each
# test module, a path that appeared in the source tree (untracked or ignored, tool caches aside)
# fails that module. New paths only: an edit to a tracked file during a run is the developer's.
TOOL_CACHES = {"__pycache__", ".pytest_cache", ".hypothesis"}


def stray_paths() -> set[str] | None:
    """Untracked and ignored paths in the source tree, or None where it is no git work tree."""
    try:
        r = subprocess.run(["git", "status", "--porcelain", "--ignored", "-z"], cwd=ROOT, capture_output=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    found = set()
    for entry in r.stdout.split(b"\0"):
        path = entry[3:].decode(errors="backslashreplace")
        if entry[:3] in (b"?? ", b"!! ") and not TOOL_CACHES & set(path.split("/")):
            found.add(path)
    return found


@pytest.fixture(scope="module", autouse=True)
def _source_tree_unchanged():
    before = stray_paths()
    yield
    if before is not None:
        new = sorted(stray_paths() - before)
        assert new == [], f"this test module wrote into the source tree: {new}; write under tmp_path instead"


# --- a file system too small for a command's output ------------------------------------------------------

class SmallFileSystems:
    """tmpfs mounts for one test (unmounted after it): mount("200k") -> an empty folder holding that many
    bytes, read_only(folder) remounts one read-only, fill(folder, leave) takes all but `leave` bytes of
    its free space. Mounting needs root (or CAP_SYS_ADMIN): elsewhere the test is skipped, saying so."""

    def __init__(self, root: Path):
        self.root, self.mounted = root, []

    def mount(self, size: str, read_only: bool = False) -> Path:
        where = self.root / f"fs{len(self.mounted)}-{size}"
        where.mkdir()
        opts = f"size={size}" + (",ro" if read_only else "")
        try:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True,
                               text=True, timeout=30)
            why = r.stderr.strip() or f"exit {r.returncode}"
        except (OSError, subprocess.TimeoutExpired) as e:
            r, why = None, str(e)
        if r is None or r.returncode != 0:
            pytest.skip(f"cannot mount a {size} tmpfs here to test a full disk ({why}); run as root")
        self.mounted.append(where)
        return where

    def read_only(self, where: Path) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, capture_output=True, timeout=30)

    def fill(self, where: Path, leave: int = 0) -> None:
        st = os.statvfs(where)
        n = st.f_bavail * st.f_frsize - leave
        if n > 0:
            with open(where / ".ballast", "wb") as f:
                os.posix_fallocate(f.fileno(), 0, n)

    def unmount_all(self) -> None:
        for where in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


@pytest.fixture
def small_fs(tmp_path):
    fs = SmallFileSystems(tmp_path)
    yield fs
    fs.unmount_all()
