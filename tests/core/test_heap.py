"""core/heap.py: a build process reuses the memory it freed instead of faulting it in again, and counts what
its heap holds free as available. Each case runs in its own process: the setting lasts a process's life."""
import subprocess
import sys

import pytest

from core.heap import _glibc

# Allocate and touch 256 MB twice (freed between), print the minor page faults of each round.
ROUNDS = """
import resource, sys
import numpy as np
np.core.multiarray._set_madvise_hugepage(False)     # 4 KB pages: counted the same on every kernel
from core.heap import held_free_bytes, keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(64 << 20, np.float32)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del a
print(kept, faults[0], faults[1], held_free_bytes())
"""

pytestmark = pytest.mark.skipif(_glibc() is None or not sys.platform.startswith("linux"),
                                reason="core/heap.py acts on glibc's malloc only (elsewhere it changes nothing)")


def _rounds(mode: str) -> tuple[bool, int, int, int]:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True).stdout
    kept, first, second, held = out.split()
    return kept == "True", int(first), int(second), int(held)


def test_a_freed_buffer_is_reused_without_faulting_its_pages_in_again():
    kept, first, second, held = _rounds("keep")
    assert kept
    assert first > (256 << 20) // 4096 // 2      # the first round faults its pages in (4 KB pages; fewer if huge)
    assert second < first // 10                  # the second reuses them
    assert held >= 256 << 20                     # and the heap holds them free after


def test_without_it_the_same_buffer_is_faulted_in_again():
    """The control: what the setting changes (glibc maps a buffer this size afresh and unmaps it when freed)."""
    kept, first, second, held = _rounds("default")
    assert not kept and held == 0
    assert second > first // 2


def test_available_memory_counts_what_the_heap_holds_free(monkeypatch):
    import core.heap
    import core.inputs
    monkeypatch.setattr(core.heap, "held_free_bytes", lambda: 0)
    base = core.inputs.available_memory()
    monkeypatch.setattr(core.heap, "held_free_bytes", lambda: 7 << 40)
    assert core.inputs.available_memory() - base > (7 << 40) - (1 << 30)     # (MemAvailable moves a little between reads)
