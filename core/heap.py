"""The build process's heap: freed memory kept for the next allocation instead of handed back to the kernel.

A build allocates and frees weight-sized buffers thousands of times: each weight read, folded and quantized,
each block of the torch reference, each dequantized matrix, transformers' model. glibc's malloc maps every
allocation over 32 MB afresh (mmap) and unmaps it when freed, and trims the top of its heap as soon as it is
free, so the kernel zeroes and faults in the same amount of memory again and again: 5.5M page faults and
10-19 s of system time in the Llama-3.2-1B int4 build on the development machine. With mmap off, one arena
(transformers loads its weights from worker threads; their own arenas would not see the main one's free
memory) and no trimming, the next buffer reuses the last one's pages.

The cost: the process keeps its high-water mark until it exits, so only a command that ends with its work
calls `keep_freed_memory` (export.build's `python -m`), never a library caller or a long-lived server, and
core.inputs.available_memory counts what the heap holds free (`held_free_bytes`) as available. After the
torch reference the build still hands the freed pages back (`release_freed_memory`), so that ONNX Runtime's
stage, the build's largest, starts from what is in use.
Where the C library is not glibc, nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
_kept = False


@functools.cache
def _glibc():
    """glibc's handle, or None (another C library: musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Have malloc keep freed memory for reuse for the rest of this process (above); False where it cannot."""
    global _kept
    libc = _glibc()
    if libc is None:
        return False
    # (a failed mallopt returns 0 and changes nothing; the three are independent)
    _kept = bool(libc.mallopt(M_MMAP_MAX, 0) & libc.mallopt(M_ARENA_MAX, 1)
                 & libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(-1)))    # -1: as size_t, never trim
    return _kept


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the system now (glibc's malloc_trim; nothing elsewhere), between two
    stages of a build: the torch reference's blocks are gone by then, but the heap keeps their pages (~1.3 GB on
    the Llama-3.2-1B shape's build) when ONNX Runtime loads the graph, its largest stage."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def held_free_bytes() -> int:
    """Bytes the heap holds free for reuse (0 unless keep_freed_memory is in force): memory this process can
    allocate again without asking the kernel."""
    libc = _glibc()
    if not _kept or libc is None or not hasattr(libc, "mallinfo2"):
        return 0
    libc.mallinfo2.restype = _Mallinfo2
    return int(libc.mallinfo2().fordblks)
