"""Shared fixtures of the CLI tests: a tiny checkpoint, its real build, a tiny training run, and a way to
call any `python -m` entry point in-process."""
from __future__ import annotations

import importlib
import io
import shutil
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import random_model, write_checkpoint

# module -> what `python -m <module>` runs; every entry point of the project
COMMANDS = {
    "models.checkpoint": "models.checkpoint",
    "models.convert": "models.convert",
    "export.build": "export.build",
    "export.verify": "export.verify",
    "graph_passes": "graph_passes.__main__",
    "runtime.generate": "runtime.generate",
    "runtime.step_timing": "runtime.step_timing",
    "runtime.triton": "runtime.triton.__main__",
    "bench.decode": "bench.decode",
    "bench.report": "bench.report",
    "bench.serve": "bench.serve",
    "bench.llamacpp": "bench.llamacpp",
    "bench.slots": "bench.slots",
    "bench.gpu_decode": "bench.gpu_decode",
    "bench.quant_quality": "bench.quant_quality",
    "bench.ort_kernels": "bench.ort_kernels",
    "train": "train.__main__",
    "train.screen_dyt": "train.screen_dyt",
    "train.report": "train.report",
    "train.tokenizer": "train.tokenizer",
    "train.shards": "train.shards",
    "train.finetune": "train.finetune",
}


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("error:")]


def cli(command: str, argv: list[str]) -> Result:
    """Run `python -m <command> argv` in this process (its main(argv)), capturing stdout and stderr."""
    main = importlib.import_module(COMMANDS[command]).main
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in argv])
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli_ckpt")
    return write_checkpoint(root / "ckpt", random_model(seed=3, n_layer=2, max_seq_len=32,
                                                        norm="taper", taper_scope="internal", gate=0.0))


@pytest.fixture(scope="session")
def tiny_build(tiny_ckpt, tmp_path_factory) -> Path:
    """A real fused build of tiny_ckpt (export.pipeline, in-process)."""
    from export.options import BuildOptions
    from export.pipeline import build
    out = tmp_path_factory.mktemp("cli_build") / "build"
    build(tiny_ckpt, out, BuildOptions(fuse=True), log=lambda _: None)
    return out


@pytest.fixture(scope="session")
def tiny_unfused_build(tiny_ckpt, tmp_path_factory) -> Path:
    """A real build of tiny_ckpt without --fuse: its one graph is model.onnx (a fused build holds only
    model.fused.onnx), the graph graph_passes folds and export.verify compares with the fused one."""
    from export.options import BuildOptions
    from export.pipeline import build
    out = tmp_path_factory.mktemp("cli_unfused_build") / "build"
    build(tiny_ckpt, out, BuildOptions(fuse=False), log=lambda _: None)
    return out


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A finished 4-step training run (python -m train's --out), for copying into a test."""
    from train.loop import train
    from train.config import TrainConfig
    out = tmp_path_factory.mktemp("cli_run") / "run"
    train(TrainConfig(preset="baseline", size="tiny", out=str(out), steps=4, eval_every=2, batch_size=2, seq_len=16,
                      eval_batches=1, calib_batches=1, corpus_stories=100, progress=False, threads=1,
                      model=dict(d_model=16, n_layer=1, n_head=2, max_seq_len=32)))
    return out


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
