"""One user-error type and one CLI runner for every `python -m` entry point.

    class CheckpointError(UserError): ...          # every package's user errors derive from UserError

    def run(argv):                                 # a command's body
        args = ArgumentParser(prog="python -m x").parse_args(argv)
        ...
        raise UserError(f"{path}: expected a build directory, found a file; choose another --out")

    def main(argv=None) -> int:
        return run_cli(run, argv)

    # and at the module's end, under the __main__ check: exit_after(main)  (sys.exit(main()), whenever
    # the Ctrl-C lands)

An entry module's first statements, before its own imports (torch takes seconds to load):

    from core.errors import guard_startup
    guard_startup(__name__)

What the user sees, whatever the command (and however early the Ctrl-C):

    bad input          one `error: ...` line on stderr, exit 1 (EXIT_USER)
    a full disk        `error: <output>: No space left on device; nothing was written (free space or
                       choose another --out)`, exit 1; the same for a full quota or a read-only file system
    bad usage          argparse's complaint as one `error: prog: ...; see --help` line, exit 2 (EXIT_USAGE)
    Ctrl-C / SIGTERM   `interrupted; nothing was written` (or which outputs are complete), exit 130
    a real bug         the traceback and a line asking to report it, exit 1

The message of a UserError names the object, what was expected, what was found and
the fix, on one line (shared/design/ARCHITECTURE.md); `details` may follow it as
indented lines (a verification lists each mismatch).
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import re
import signal
import sys
import threading
import traceback

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


def written_so_far() -> str:
    """What this command has completed, for a message about a stop: `nothing was written`, or
    `complete: A, B; nothing else was written`."""
    from core.outputs import committed_outputs
    done = committed_outputs()
    if done:
        return "complete: " + ", ".join(str(p) for p in done) + "; nothing else was written"
    return "nothing was written"


class NoRoomError(UserError):
    """An output that could not be written for want of room (ENOSPC, EDQUOT) or on a read-only file
    system (EROFS), named as the user will look for it (never a temporary path, never an input):

        runs/x/model.safetensors: No space left on device; nothing was written (free space or choose another --out)
    """

    def __init__(self, path, code: int, option: str = "--out"):
        self.path, self.errno, self.reason, self.remedy = path, code, os.strerror(code), NO_ROOM[code]
        where = f"{path}: " if path is not None else ""
        super().__init__(f"{where}{self.reason}; {written_so_far()} ({self.remedy} or choose another {option})")


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


# --- the runner -----------------------------------------------------------------------------

NOTHING_WRITTEN = "interrupted; nothing was written"
# run_cli's fix for a full disk met outside the atomic writer (which names the command's own option)
ANY_OUTPUT = "output path"


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


# A Ctrl-C that lands while Python runs a weakref callback or a __del__ (importlib's module-lock
# callback runs in every import, and our commands import lazily) raises its KeyboardInterrupt
# there, where CPython prints it as "Exception ignored ... Traceback" and drops it: the command ran
# on, deaf to it, and wrote its output (CI, runtime.triton repo). run_cli keeps such an interrupt
# here instead of printing it; the atomic writers raise it again before they replace anything
# (raise_if_dropped_interrupt), and run_cli answers it as the interrupt it was.
_dropped_interrupt = threading.Event()


def _keeping_dropped_interrupts(previous_hook):
    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _dropped_interrupt.set()
        else:
            previous_hook(unraisable)
    return hook


def raise_if_dropped_interrupt() -> None:
    """Raise (once) the KeyboardInterrupt of a Ctrl-C that CPython dropped; a no-op otherwise."""
    if _dropped_interrupt.is_set():
        _dropped_interrupt.clear()
        raise KeyboardInterrupt


def interrupted_message() -> str:
    return "interrupted; " + written_so_far()


def guard_startup(name: str) -> None:
    """Called first by every `python -m` entry module with its __name__: until run_cli takes over, a
    Ctrl-C or SIGTERM prints run_cli's interrupt line and exits 130 at once.

    Without it, a Ctrl-C while the module's imports load (torch: seconds) raised KeyboardInterrupt
    out of an import, a 30-line traceback. The handler exits rather than raising: nothing has been
    written yet, and a KeyboardInterrupt raised inside an import can be swallowed by importlib
    (train/interrupts.py). A no-op for a module imported as a library (or by the tests), and a
    signal the process was started deaf to (nohup, a background job) stays ignored.
    """
    if name != "__main__":
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_at_startup)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupted_at_startup)


def _interrupted_at_startup(signum, frame):
    os.write(2, f"error: {NOTHING_WRITTEN}\n".encode())
    os._exit(EXIT_INTERRUPTED)


def _end_startup_guard() -> None:
    """Hand SIGINT / SIGTERM back to Python's defaults (run_cli then raises KeyboardInterrupt on either)."""
    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(sig) is _interrupted_at_startup:
            signal.signal(sig, default)


def exit_after(main):
    """sys.exit with a `python -m` entry point's exit code (command_code), deaf to Ctrl-C from then on
    (the last line of every entry module, under its __main__ check)."""
    sys.exit(command_code(main))


def command_code(main) -> int:
    """Run main() (run_cli inside it) and return its exit code, ignoring SIGINT / SIGTERM from then on.

    A Ctrl-C in the few instructions between run_cli's answer and the exit would otherwise escape as
    a top-level KeyboardInterrupt traceback (seen in CI's interrupt tests); it is answered here as any
    other: the interrupt line (which lists the outputs already complete), exit 130. After main,
    interpreter shutdown resets SIGINT to the default action, so a Ctrl-C in that last fraction of
    a second would otherwise kill the process by signal and hide the real exit code.
    """
    try:
        code, interrupted = main(), False
    except KeyboardInterrupt:
        code, interrupted = EXIT_INTERRUPTED, True
    _ignore_interrupts()
    if interrupted:
        print(f"error: {interrupted_message()}", file=sys.stderr)
    if code == EXIT_INTERRUPTED:
        _forget_interrupt_seen_by_c_code()
    return code


def _ignore_interrupts():
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _forget_interrupt_seen_by_c_code():
    """Tell CPython the Ctrl-C was handled, so the exit code stays 130.

    A KeyboardInterrupt that passes through Python code run by a C extension with
    PyRun_String (e.g. pybind11's py::exec; torch is built on pybind11) sets CPython's
    _Py_UnhandledKeyboardInterrupt even when our handler catches it later; at exit
    CPython then kills the process with SIGINT (exit -2 instead of 130). Seen in CI on
    `python -m train` interrupted mid-step. Where the flag cannot be reached (not
    CPython), exit at once: outputs are complete and temporaries gone by now.
    """
    try:
        import ctypes
        ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 0
    except (ImportError, AttributeError, ValueError, OSError):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)


def _caused_by_interrupt(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def run_cli(run, argv: list[str] | None = None, speaks: bool = True) -> int:
    """Run a command body `run(argv) -> int` with the uniform error contract (module docstring).

    SIGTERM is handled like Ctrl-C (so `kill PID` cleans up the same way); output writers
    remove their temporary files on the resulting KeyboardInterrupt.

    speaks=False: one of several processes of a job that another one speaks for (a rank other than
    0 under torchrun): its user errors (except UserError.own_process ones) and interrupts, which every
    process meets alike, are not printed again; the exit codes stay the same.
    """
    from core.outputs import forget_committed
    argv = sys.argv[1:] if argv is None else list(argv)
    forget_committed()          # the interrupt message lists what this command completed
    _end_startup_guard()
    _dropped_interrupt.clear()
    previous_hook, sys.unraisablehook = sys.unraisablehook, _keeping_dropped_interrupts(sys.unraisablehook)
    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:          # not the main thread (a test calling main in a thread)
        pass
    try:
        bad = next((i for i, a in enumerate(argv) if "\0" in a), None)
        if bad is not None:     # an OS command line cannot carry one; a caller building argv by hand can
            raise UsageError(f"argument {bad + 1} contains a NUL byte; pass text without one")
        code = run(argv)
        if code != EXIT_INTERRUPTED:    # (a command that answered the Ctrl-C itself has said so)
            raise_if_dropped_interrupt()    # it finished deaf to a Ctrl-C: exit as interrupted
        return code
    except UserError as e:
        if speaks or e.own_process:
            print(f"error: {e}", file=sys.stderr)
            for line in e.details:
                print(f"  - {line}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        if speaks:
            print(f"error: {interrupted_message()}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except MemoryError:
        print("error: out of memory; use a smaller model, batch, capacity or input", file=sys.stderr)
        return EXIT_USER
    except BrokenPipeError:     # `cmd | head`: the reader left; not an error of ours
        return EXIT_OK
    except OSError as e:        # disk full, permission denied, a path that vanished: the user's to fix
        if e.errno in NO_ROOM:
            # a copy's error names (source, destination): the destination is what did not fit
            print(f"error: {NoRoomError(e.filename2 or e.filename, e.errno, ANY_OUTPUT)}", file=sys.stderr)
        else:
            where = f"{e.filename}: " if e.filename else ""
            print(f"error: {where}{e.strerror or first_line(e)}; {written_so_far()}", file=sys.stderr)
        return EXIT_USER
    except SystemExit as e:     # a library calling sys.exit: keep its code, never a traceback
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USER)
        if isinstance(e.code, str):
            print(e.code if e.code.startswith("error:") else f"error: {e.code}", file=sys.stderr)
        return code
    except Exception as e:
        if _caused_by_interrupt(e):     # a library (torch's exporter) wrapped the Ctrl-C in its own error
            if speaks:
                print(f"error: {interrupted_message()}", file=sys.stderr)
            return EXIT_INTERRUPTED
        if io_errno(e) in NO_ROOM:      # a foreign writer's full disk (safetensors' SafetensorError), unnamed
            print(f"error: {NoRoomError(None, io_errno(e), ANY_OUTPUT)}", file=sys.stderr)
            return EXIT_USER
        traceback.print_exc()
        print(f"error: {REPORT_BUG}", file=sys.stderr)
        return EXIT_USER
    finally:
        sys.unraisablehook = previous_hook
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        sys.stdout.flush()
