"""Fixtures for the runtime tests: a tiny random checkpoint and its ONNX build, made once per session."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import random_model, write_checkpoint

REPO = Path(__file__).resolve().parents[2]
CAPACITY = 48   # small cache: prompts + new tokens must fit, and the capacity errors are cheap to hit


def has_export_build() -> bool:
    return importlib.util.find_spec("export.build") is not None


def make_build(checkpoint: Path, out: Path, use_export_build: bool = True) -> Path:
    """A build directory for `checkpoint`.

    With use_export_build and export/build.py present: the real driver,
    `python -m export.build --fuse --checkpoint CKPT --out DIR` (model.fused.onnx).
    Otherwise export_onnx (same I/O contract, unfused) plus config.json / tokenizer.json.
    """
    if use_export_build and has_export_build():
        proc = subprocess.run([sys.executable, "-m", "export.build", "--fuse", "--checkpoint", str(checkpoint),
                               "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=900)
        assert proc.returncode == 0, f"export.build failed for {checkpoint}:\n{proc.stderr[-2000:]}"
        return out
    from tests.export.oracle import export_onnx
    from models.checkpoint import load_checkpoint
    out.mkdir(parents=True, exist_ok=True)
    export_onnx(load_checkpoint(checkpoint), out / "model.onnx")
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(checkpoint / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The checkpoint dir of a 2-layer random model, capacity CAPACITY (torch only: no ONNX export)."""
    root = tmp_path_factory.mktemp("tiny_ckpt")
    return write_checkpoint(root / "ckpt", random_model(seed=1, n_layer=2, max_seq_len=CAPACITY))


@pytest.fixture(scope="session")
def tiny(tiny_checkpoint, tmp_path_factory):
    """(checkpoint dir, build dir) of tiny_checkpoint."""
    build = make_build(tiny_checkpoint, tmp_path_factory.mktemp("tiny") / "build",
                       use_export_build=False)  # fast; the zoo test uses export.build
    return tiny_checkpoint, build


@pytest.fixture(scope="session")
def tiny_gqa(tiny, tmp_path_factory):
    """tiny's checkpoint built with --attention gqa (ONNX Runtime's GroupQueryAttention, what export.build
    makes for the CPU): a multi-token step on several rows must start at position 0 there."""
    out = tmp_path_factory.mktemp("tiny_gqa") / "build"
    proc = subprocess.run([sys.executable, "-m", "export.build", "--fuse", "--attention", "gqa", "--checkpoint",
                           str(tiny[0]), "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tiny[0], out
