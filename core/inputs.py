"""Checks of user input at the boundary, before anything is allocated or written.

    read_text_file(path, "--batch-file", max_bytes=1 << 20)   # text only, size limit stated
    check_memory(nbytes, "a KV cache for batch 64", "use a smaller --batch")

Torch-free and numpy-free.
"""
from __future__ import annotations

import os
from pathlib import Path

from core.errors import UserError

MIB = 1 << 20
# Refuse an allocation above this share of the available memory: the rest is for the
# model's weights, the runtime's own buffers and everything else on the machine.
MEMORY_SHARE = 0.8


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable, and what this process's heap holds
    free for reuse: core/heap.py), or None when unknown."""
    from core.heap import held_free_bytes
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 + held_free_bytes()
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def check_memory(nbytes: int, what: str, fix: str, share: float = MEMORY_SHARE, needs: str | None = None) -> None:
    """Refuse (UserError, one line) `nbytes` above `share` of the available memory: an allocation
    (MEMORY_SHARE), or a whole run's estimated peak (share 1; `needs` says how the estimate is made up)."""
    avail = available_memory()
    if avail is not None and nbytes > share * avail:
        raise UserError(f"{what}: needs {needs or f'{nbytes:,} bytes ({human_bytes(nbytes)})'}, this machine has "
                        f"{human_bytes(avail)} available; {fix}")


def read_text_file(path: str | os.PathLike, what: str, max_bytes: int = 16 * MIB) -> str:
    """The UTF-8 text of a file, or UserError: missing, a directory, unreadable, too large, binary."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} {p}: expected a text file, found no such file; check the path")
    if p.is_dir():
        raise UserError(f"{what} {p}: expected a text file, found a directory; name a file")
    try:
        size = p.stat().st_size
        if size > max_bytes:
            raise UserError(f"{what} {p}: expected a text file of at most {human_bytes(max_bytes)}, "
                            f"found {human_bytes(size)}; split it")
        raw = p.read_bytes()
    except OSError as e:
        raise UserError(f"{what} {p}: expected a readable text file, found {(e.strerror or str(e)).lower()}; "
                        "check its permissions") from None
    if b"\0" in raw:
        raise UserError(f"{what} {p}: expected a text file, found binary data (NUL bytes); name a text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {p}: expected UTF-8 text, found an undecodable byte at offset {e.start}; "
                        "convert it to UTF-8") from None


def read_json_file(path: str | os.PathLike, what: str, max_bytes: int = 64 * MIB):
    """Parsed JSON of a file, or UserError naming the file and the problem."""
    import json
    text = read_text_file(path, what, max_bytes)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{what} {path}: expected JSON, found an error ({e.msg} at line {e.lineno} column "
                        f"{e.colno}); fix or re-create the file") from None


def load_restricted_pickle(path: str | os.PathLike, what: str, allowed, fix: str):
    """The object a pickle file holds, unpickled calling nothing but the classes and functions
    `allowed(module, name)` accepts (pickle.Unpickler.find_class, the pickle documentation's
    "Restricting Globals"). A pickle runs code only by calling what it names (os.system, eval, ...):
    any other name is refused in one line (UserError naming it) before its module is even imported,
    so nothing of a crafted file runs. A damaged or unreadable file is one line too."""
    import io
    import pickle

    class Refused(Exception):
        pass

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if not allowed(module, name):
                raise Refused(f"{module}.{name}")
            return super().find_class(module, name)

    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"{path}: expected {what}, found an unreadable file ({e.strerror or e}); {fix}") from None
    try:
        return Restricted(io.BytesIO(raw)).load()
    except Refused as e:
        raise UserError(f"{path}: expected {what}, found a pickle that calls {e}; refused, because loading it "
                        f"could run code; {fix}") from None
    except Exception as e:      # truncated, not a pickle, a persistent id: whatever the unpickler met
        detail = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise UserError(f"{path}: expected {what}, found a damaged pickle ({detail[:200]}); {fix}") from None


def check_text(text: str, what: str) -> str:
    """Text from the command line: refuse undecodable bytes (surrogate escapes of a non-UTF-8 argv)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{what}: expected UTF-8 text, found undecodable bytes; pass UTF-8 text") from None
    return text
