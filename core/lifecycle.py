"""A command's process lifecycle: the CLI runner, its Ctrl-C / SIGTERM handling, signal holding around
the atomic writer's swaps, and the registry of the outputs this command has completed.

    def main(argv=None) -> int:
        return run_cli(run, argv)                  # run(argv) -> int is the command's body

    # and at the module's end, under the __main__ check: exit_after(main)  (sys.exit(main()), whenever
    # the Ctrl-C lands)

An entry module's first statements, before its own imports (torch takes seconds to load):

    from core.lifecycle import guard_startup
    guard_startup(__name__)

What the user sees, whatever the command (and however early the Ctrl-C):

    bad input          one `error: ...` line on stderr, exit 1 (EXIT_USER)
    a full disk        `error: <output>: No space left on device; nothing was written (free space or
                       choose another --out)`, exit 1; the same for a full quota or a read-only file system
    bad usage          argparse's complaint as one `error: prog: ...; see --help` line, exit 2 (EXIT_USAGE)
    Ctrl-C / SIGTERM   `interrupted; nothing was written` (or which outputs are complete), exit 130
    a real bug         the traceback and a line asking to report it, exit 1

The error types are core.errors'; the writers (core.outputs) report each output they complete here
(note_committed), hold the signals while they swap one into place (signals_held), and raise here a
Ctrl-C that CPython dropped (raise_if_dropped_interrupt) before they replace anything.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from core.errors import (EXIT_INTERRUPTED, EXIT_OK, EXIT_USER, NO_ROOM, REPORT_BUG, NoRoomError, UsageError,
                         UserError, first_line, io_errno)

# --- the outputs this command completed --------------------------------------------------------

_committed: list[Path] = []
_claimed: dict[str, str] = {}   # claim_dir's directories -> their option: a file finished in one is an output
_lock = threading.Lock()


def forget_committed() -> None:
    with _lock:
        _committed.clear()
        _claimed.clear()


def committed_outputs() -> list[Path]:
    """Outputs this process has finished writing (for the interrupt message)."""
    with _lock:
        return list(_committed)


def note_committed(out: Path) -> None:
    """An output this command (or a child process of it) finished writing (for the interrupt message)."""
    with _lock:
        _committed.append(Path(out))


def note_claimed(directory: Path, option: str) -> None:
    """A directory the command fills file by file (core.outputs.claim_dir), named by `option` in messages:
    each file finished in it is an output of its own (note_replaced_in)."""
    with _lock:
        _claimed[os.path.abspath(directory)] = option


def claimed_option(directory: Path) -> str | None:
    """The option of a claimed directory (note_claimed), None for any other."""
    return _claimed.get(os.path.abspath(directory))


def note_replaced_in(directory: Path, name: str) -> None:
    """A file replaced inside a directory: an output of this command (once) when the directory is claimed."""
    path = Path(directory) / name
    with _lock:
        if os.path.abspath(directory) in _claimed and path not in _committed:
            _committed.append(path)


def written_so_far() -> str:
    """What this command has completed, for a message about a stop: `nothing was written`, or
    `complete: A, B; nothing else was written`."""
    done = committed_outputs()
    if done:
        return "complete: " + ", ".join(str(p) for p in done) + "; nothing else was written"
    return "nothing was written"


def no_room(path, code: int, option: str = "--out") -> NoRoomError:
    """The NoRoomError of an output that did not fit, saying what this command completed before it."""
    return NoRoomError(path, code, option, written=written_so_far())


# --- interrupts ------------------------------------------------------------------------------

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


# --- holding signals -------------------------------------------------------------------------

HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held():
    """Hold SIGINT/SIGTERM until the block ends, then deliver what came meanwhile (main thread only, where
    Python runs signal handlers; a no-op elsewhere). A Ctrl-C that CPython dropped before is raised first:
    it, too, comes before the swap.

    Blocking the signals in this thread is not enough: a signal sent to the process goes to any thread
    that does not block it (a library's worker, pytest-xdist's I/O thread), and CPython then runs the
    handler in the main thread all the same. So the handlers, too, are swapped for one that only notes
    the signal; the noted one is raised again once the old handlers are back."""
    raise_if_dropped_interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    old_handlers = {sig: signal.signal(sig, lambda sig, frame: held.append(sig)) for sig in HELD_SIGNALS}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(HELD_SIGNALS)) if hasattr(signal, "pthread_sigmask") else None
    try:
        yield
    finally:
        if old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        for sig in dict.fromkeys(held):
            signal.raise_signal(sig)


def made_whole(make, remove):
    """make() a temporary with SIGINT/SIGTERM held, and return it. A Ctrl-C that lands meanwhile (the
    test suite's lands the instant the temporary shows up: inside mkdtemp, after its mkdir) is raised
    once make() is done, after remove(what it made): a name lost to the interrupt would be a folder
    nothing ever removes."""
    made = None
    try:
        with signals_held():
            made = make()
    except BaseException:
        if made is not None:
            remove(made)
        raise
    return made


# --- the runner ------------------------------------------------------------------------------

def run_cli(run, argv: list[str] | None = None, speaks: bool = True) -> int:
    """Run a command body `run(argv) -> int` with the uniform error contract (module docstring).

    SIGTERM is handled like Ctrl-C (so `kill PID` cleans up the same way); output writers
    remove their temporary files on the resulting KeyboardInterrupt.

    speaks=False: one of several processes of a job that another one speaks for (a rank other than
    0 under torchrun): its user errors (except UserError.own_process ones) and interrupts, which every
    process meets alike, are not printed again; the exit codes stay the same.
    """
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
            print(f"error: {no_room(e.filename2 or e.filename, e.errno, ANY_OUTPUT)}", file=sys.stderr)
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
            print(f"error: {no_room(None, io_errno(e), ANY_OUTPUT)}", file=sys.stderr)
            return EXIT_USER
        traceback.print_exc()
        print(f"error: {REPORT_BUG}", file=sys.stderr)
        return EXIT_USER
    finally:
        sys.unraisablehook = previous_hook
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        sys.stdout.flush()
