"""A Ctrl-C (or SIGTERM) that is never lost by the train commands.

Python raises KeyboardInterrupt wherever the main thread is when the signal arrives. Raised
inside a weakref callback or a __del__, it is printed as "Exception ignored" and dropped:
importlib's module-lock callbacks run during every import, and a Ctrl-C about 1.8 s into
`import torch` on the 2-core machine was dropped so, the command training on, deaf to it.
The train commands therefore note each such signal (`noting_interrupts`, around a command:
`run_train_cli`)
and their loops call `raise_if_interrupted` at each step, which raises the KeyboardInterrupt
again if it was dropped. Used as a library (no command around it), both are no-ops.
"""
from __future__ import annotations

import contextlib
import signal
import threading

_noted = threading.Event()


@contextlib.contextmanager
def noting_interrupts():
    """Within the block, SIGINT and SIGTERM keep their handlers and are also noted."""
    _noted.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if callable(handler):           # the handler that raises KeyboardInterrupt (not SIG_IGN / SIG_DFL)
            previous[sig] = handler
            signal.signal(sig, lambda signum, frame, handler=handler: (_noted.set(), handler(signum, frame)))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt of a noted signal (once), if its own was dropped."""
    if _noted.is_set():
        _noted.clear()
        raise KeyboardInterrupt


def speaks_for_job() -> bool:
    """Whether this process prints the job's messages: rank 0 under torchrun (RANK), or the only process.
    The ranks meet the same errors and torchrun forwards one Ctrl-C to each: one line, not one per rank."""
    import os
    rank = os.environ.get("RANK", "0").strip()
    return not rank.isdigit() or int(rank) == 0        # a malformed RANK: every rank says so


def run_train_cli(body, argv: list[str] | None = None) -> int:
    """core.lifecycle.run_cli for a train command: a Ctrl-C dropped by an import still stops it, and under
    torchrun rank 0 alone prints the one-line error or interrupt (speaks_for_job)."""
    from core.lifecycle import run_cli

    def noting(args: list[str]) -> int:
        with noting_interrupts():
            return body(args)
    return run_cli(noting, argv, speaks=speaks_for_job())
