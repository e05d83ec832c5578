"""python -m train.launch [torchrun's options] -m train ...   (or -m train.finetune ...)

torchrun with this project's error contract. torchrun (torch.distributed.run) ends every job that a
rank failed or a signal stopped with its own Python traceback (ChildFailedError, SignalException)
and exit status 1, whatever the ranks printed and exited with: under torchrun a user error or a
Ctrl-C is rank 0's one line, then torchrun's report, then status 1. This runs the same launcher
(torch.distributed.run's parse_args and run: the same options, environment variables and
rendezvous) quietly, and then exits as the ranks did: with the exit code of the first rank that
failed (1: a user error, 2: the command line, 130: Ctrl-C or SIGTERM, which the launcher forwards
to every rank), 130 when the launcher itself was stopped, and no traceback. A rank killed by a
signal (SIGKILL, the OOM killer) said nothing: that is said in one line.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import logging
import signal
import sys

from core.errors import EXIT_INTERRUPTED, EXIT_USER


def exit_code_of(exitcode: int) -> int:
    """A rank's exit status as a shell reports it: a signal's death (negative) as 128 + the signal."""
    return 128 - exitcode if exitcode < 0 else exitcode


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    logging.disable(logging.ERROR)      # (this process only) its warnings and errors name pids, not causes
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:            # killed: the rank could print nothing of its own
            try:
                name = signal.Signals(-failure.exitcode).name
            except ValueError:
                name = f"signal {-failure.exitcode}"
            print(f"error: rank {rank} (pid {failure.pid}) was killed by {name}; see the other ranks' lines above "
                  "for what the run directory holds", file=sys.stderr)
        return exit_code_of(failure.exitcode) or EXIT_USER
    except (SignalException, KeyboardInterrupt):   # the ranks were stopped with it and said what is held
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
