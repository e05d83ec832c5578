"""The user-error types every package's errors derive from, and the argparse that raises them.

    class CheckpointError(UserError): ...          # every package's user errors derive from UserError

    def run(argv):                                 # a command's body (core.lifecycle.run_cli runs it)
        args = ArgumentParser(prog="python -m x").parse_args(argv)
        ...
        raise UserError(f"{path}: expected a build directory, found a file; choose another --out")

The message of a UserError names the object, what was expected, what was found and
the fix, on one line (shared/design/ARCHITECTURE.md); `details` may follow it as
indented lines (a verification lists each mismatch). The exit codes are here (a UserError
carries its own); what a command prints and returns for each error is core.lifecycle's run_cli.
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import re

EXIT_OK, EXIT_USER, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
REPORT_BUG = "this is a bug in tapernorm-deploy; please report it with the command and the traceback above"
# Flags that reach a C int or an INT32 wire field are capped here rather than wrapped around.
INT32_MAX = 2**31 - 1


class UserError(Exception):
    """A problem the user can fix: str(e) is one line `<object>: <expected>, <found>; <fix>`.

    details: further lines shown under the error line (e.g. one per mismatch).
    """

    exit_code = EXIT_USER
    # Of the processes of one job (torchrun's ranks) one speaks for it (run_cli's `speaks`); an error that
    # only this process can meet (its own device, a lost peer) sets this to be said by whichever meets it.
    own_process = False

    def __init__(self, message: str, details: list[str] | None = None):
        super().__init__(" ".join(str(message).split("\n")))
        self.details = list(details or [])


class UsageError(UserError):
    """The command line itself is wrong (unknown flag, missing argument, unparsable value)."""

    exit_code = EXIT_USAGE


# A write that failed for want of room, not for a bug: errno -> what makes room (the fix's first half).
NO_ROOM = {errno.ENOSPC: "free space", errno.EDQUOT: "free space", errno.EROFS: "make the file system writable"}
_OS_ERROR = re.compile(r"\(os error (\d+)\)")     # how Rust's std::io::Error ends (safetensors, tokenizers)


def io_errno(e: BaseException | None) -> int | None:
    """The errno behind a failed write, else None: an OSError's, one a foreign writer spells only in its
    text (safetensors raises SafetensorError "I/O error: No space left on device (os error 28)"), or that
    of the error a foreign one was raised over (torch.save's "[enforce fail at inline_container.cc]
    unexpected pos" has the OSError as its __context__; torch.distributed.checkpoint lists each rank's
    in `failures`). A UserError other than NoRoomError is the project's own message, and a stop (SystemExit,
    Ctrl-C) raised while a failed write was handled is no write: None."""
    seen, todo = set(), [e]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen or isinstance(e, (SystemExit, KeyboardInterrupt, GeneratorExit)) or (
                isinstance(e, UserError) and not isinstance(e, NoRoomError)):
            continue
        seen.add(id(e))
        code = getattr(e, "errno", None) if isinstance(e, (OSError, NoRoomError)) else None
        found = code or next((int(m) for m in _OS_ERROR.findall(str(e))), None)
        if found:
            return found
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, None if e.__suppress_context__ else e.__context__]
    return None


class NoRoomError(UserError):
    """An output that could not be written for want of room (ENOSPC, EDQUOT) or on a read-only file
    system (EROFS), named as the user will look for it (never a temporary path, never an input):

        runs/x/model.safetensors: No space left on device; nothing was written (free space or choose another --out)

    written: what the command completed before it (core.lifecycle.no_room says, from the outputs it
    committed); the default suits an error met before anything was written.
    """

    def __init__(self, path, code: int, option: str = "--out", written: str = "nothing was written"):
        self.path, self.errno, self.reason, self.remedy = path, code, os.strerror(code), NO_ROOM[code]
        where = f"{path}: " if path is not None else ""
        super().__init__(f"{where}{self.reason}; {written} ({self.remedy} or choose another {option})")


def first_line(e: BaseException) -> str:
    """The first non-empty line of an exception's text, else its type name (for wrapping foreign errors)."""
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()
    return type(e).__name__


# --- argparse ----------------------------------------------------------------------------

class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line) instead of printing its usage block and exiting.

    No prefix matching (allow_abbrev=False, its sub-commands' parsers too): `--check DIR` must not
    quietly mean `--checkpoint DIR`, and a wrapper that screens a child's options by name (bench.scale
    --options) sees what the child will read."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}; see --help")


def _number(kind, lo, hi, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f"in [{lo}, {hi}]" if lo is not None and hi is not None else (f">= {lo}" if lo is not None else f"<= {hi}")
            raise argparse.ArgumentTypeError(f"{text} is out of range; expected {what} {bounds}")
        return value
    parse.__name__ = what          # argparse names the type in its message
    return parse


def int_in(lo: int | None = None, hi: int | None = INT32_MAX):
    """argparse type: an integer in [lo, hi] (default upper bound INT32_MAX: no silent wrap-around)."""
    return _number(int, lo, hi, "an integer")


def float_in(lo: float | None = None, hi: float | None = None):
    """argparse type: a finite float in [lo, hi]."""
    return _number(float, lo, hi, "a number")


positive_int = int_in(1)
nonnegative_int = int_in(0)
seed_int = int_in(0, 2**63 - 1)       # numpy and torch seeds: non-negative, 64-bit
