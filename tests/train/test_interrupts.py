"""A Ctrl-C that Python drops (raised inside a __del__ or a weakref callback, as during an import)
still stops a train command at its next step."""
import os
import signal

import pytest

from train.interrupts import noting_interrupts, raise_if_interrupted


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Python's own SIGINT handler for the test, whatever this process inherited: a background job
    of a non-interactive shell starts with SIGINT ignored, and noting_interrupts rightly leaves an
    ignored signal ignored (then no KeyboardInterrupt exists to note)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class _CtrlCInDel:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):      # the handler runs here, inside __del__: its KeyboardInterrupt is dropped
            pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_dropped_ctrl_c_is_raised_at_the_next_check():
    before = signal.getsignal(signal.SIGINT)
    with noting_interrupts():
        _CtrlCInDel()                # "Exception ignored in: ... KeyboardInterrupt", and on we go
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
        raise_if_interrupted()       # raised once
    assert signal.getsignal(signal.SIGINT) is before
