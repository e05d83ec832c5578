"""A Ctrl-C while export.build reads the weights is the interrupt it is: exit 130 and the interrupt line, never
"cannot be read" / a corrupt file and exit 1 (issue 42).

The Ctrl-C is sent by the read itself, at a fixed read, so the moment is exact: the reader then does what
safetensors' get_tensor does with a KeyboardInterrupt raised inside it (measured by sending SIGINT at random
moments: 1 read in 5), swallows it and raises a ValueError, or returns as if nothing happened."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import default_sigint

ROOT = Path(__file__).resolve().parents[2]

DRIVER = """
import os, signal, sys
import models.hf_files as files
real, calls, mode = files.read_safetensor, [0], sys.argv[1]
def read(where, name):
    calls[0] += 1
    if calls[0] != 3:
        return real(where, name)
    try:                                    # the Ctrl-C lands inside the read, and the reader loses it
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100000):
            pass
    except BaseException:
        pass
    if mode == "raises":
        raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'")
    return real(where, name)
files.read_safetensor = read
from core.lifecycle import exit_after
from export.build import main
sys.argv[1:] = sys.argv[2:]
exit_after(main)
"""


@pytest.mark.parametrize("reader", ["raises", "returns"])
def test_a_ctrl_c_lost_inside_a_weight_read_exits_130(tmp_path, tiny_ckpt, reader):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", DRIVER, reader, "--fuse", "--checkpoint", str(tiny_ckpt),
                           "--out", str(tmp_path / "b")], cwd=ROOT, env=env, capture_output=True, text=True,
                          preexec_fn=default_sigint, timeout=300)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "error: interrupted; nothing was written", proc.stderr[-2000:]
    assert "cannot be read" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "b").exists() and [p.name for p in tmp_path.iterdir()] == []


def test_a_stop_raised_by_a_read_passes_through_untouched(tiny_ckpt, monkeypatch):
    """KeyboardInterrupt, SystemExit: not Exceptions, never a CheckpointError."""
    import models.hf_files
    from models.weights import open_weights
    source = open_weights(tiny_ckpt)
    for stop in (KeyboardInterrupt, SystemExit):
        def read(where, name, stop=stop):
            raise stop()
        monkeypatch.setattr(models.hf_files, "read_safetensor", read)
        source = open_weights(tiny_ckpt)
        with pytest.raises(stop):
            source.tensor("wte.weight")
