"""Ctrl-C (SIGINT) during export.build, train and runtime.triton repo, at several moments: the previous
output stays whole (or the new one is complete), exit 130, no temporary left behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli.conftest import copy_tree
from tests.helpers import default_sigint, snapshot

ROOT = Path(__file__).resolve().parents[2]


def _start(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", *map(str, args)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint)


def _interrupt_when(proc, line_prefix: str | None = None, temp_in: Path | None = None, after_s: float = 0.0):
    """SIGINT once stdout shows a line starting with line_prefix, or once a temporary of ours shows up in
    `temp_in` (the command is past start-up, inside its own code), then after_s seconds more."""
    if line_prefix is not None:
        for line in proc.stdout:
            if line.startswith(line_prefix):
                break
    else:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and not any(
                ".tmp-" in p.name or ".work-" in p.name for p in temp_in.iterdir()):
            time.sleep(0.005)
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, err


def _no_temporaries(parent: Path):
    left = [p.name for p in parent.iterdir() if p.name.startswith(".") and (".tmp-" in p.name or ".work-" in p.name
                                                                          or ".old-" in p.name)]
    assert left == []


# a Ctrl-C at the second stage runs by default (the interrupt path is the same code at every
# stage); the later stages, ~18 s each, with -m slow
@pytest.mark.parametrize("moment", ["[2/6]", pytest.param("[4/6]", marks=pytest.mark.slow),
                                    pytest.param("[6/6]", marks=pytest.mark.slow)])
def test_sigint_during_export_build(tmp_path, tiny_ckpt, tiny_build, moment):
    out = copy_tree(tiny_build, tmp_path / "b")
    before = snapshot(out)
    proc = _start("export.build", "--fuse", "--checkpoint", tiny_ckpt, "--out", out)
    code, err = _interrupt_when(proc, moment)
    assert "Traceback" not in err, err
    if code == 130 and "complete:" not in err:
        assert snapshot(out) == before and "nothing was written" in err
    else:                                   # the signal came after the swap: the new build, whole
        assert code in (0, 130) and json.loads((out / "report.json").read_text())["fuse"] is True
    _no_temporaries(tmp_path)


@pytest.mark.parametrize("after_s", [0.0, 1.0, 3.0])
def test_sigint_during_train(tmp_path, tiny_run, after_s):
    from models.checkpoint import load_checkpoint
    run = tmp_path / "run"
    proc = _start("train", "--preset", "baseline", "--out", run, "--steps", "400", "--eval-every", "2",
                  "--d-model", "16", "--n-layer", "1", "--n-head", "2", "--batch-size", "2", "--seq-len", "16",
                  "--eval-batches", "1", "--corpus-stories", "100", "--quiet", "--threads", "1")
    code, err = _interrupt_when(proc, temp_in=tmp_path, after_s=after_s)
    assert code == 130 and "Traceback" not in err, err
    assert err.startswith("error: training interrupted") or err.strip() == "error: interrupted; nothing was written", err
    if run.exists():                        # a complete checkpoint of some step, and how to continue it
        step = json.loads((run / "train_log.json").read_text())["step"]
        assert step > 0 and f"step {step}" in err and "--resume" in err
        load_checkpoint(run)
    else:
        assert "nothing was written" in err
    _no_temporaries(tmp_path)


@pytest.mark.parametrize("after_s", [0.0, 0.05, 0.15, 0.3])
def test_sigint_during_triton_repo(tmp_path, tiny_build, after_s):
    repo = tmp_path / "repo"
    r = subprocess.run([sys.executable, "-m", "runtime.triton", "repo", "--build", tiny_build, "--out", repo],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (repo / "generate" / "config.pbtxt").write_text((repo / "generate" / "config.pbtxt").read_text() + "# v1\n")
    before = snapshot(repo)
    proc = _start("runtime.triton", "repo", "--build", tiny_build, "--out", repo)
    code, err = _interrupt_when(proc, temp_in=tmp_path, after_s=after_s)
    assert "Traceback" not in err, err
    if code == 130 and "complete:" not in err:
        assert snapshot(repo) == before
    else:
        assert code in (0, 130) and "# v1" not in (repo / "generate" / "config.pbtxt").read_text()
        assert (repo / "decoder_onnx" / "1" / "model.onnx").is_file()
    _no_temporaries(tmp_path)
