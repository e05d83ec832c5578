"""Fixtures for the Triton tests: one fused build of a tiny random DyT model and its repository.

Every test here needs tritonclient (the ModelConfig protobuf); the server tests also
need nvidia-pytriton (the bundled tritonserver). Both come with the triton extra:
pip install -e '.[dev,triton]'. Without them the tests skip, saying so.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import random_model, write_checkpoint

REPO = Path(__file__).resolve().parents[2]
CAPACITY = 2048  # prompt + 64 new tokens must fit; long enough that a 2016-token request outlives its
                 # client's disconnect (tests/triton/test_serving.py): a killed client's cancellation reached
                 # the scheduler 75-182 decode steps after the kill here, alone, and in one CI run under load
                 # not within 480 steps (capacity 512), so the request ran to its length


def require(module: str, what: str) -> None:
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        pytest.skip(f"{what} need {module} (the triton extra: pip install -e '.[dev,triton]')")


def export_build_has_triton_repo() -> bool:
    spec = importlib.util.find_spec("export.build")
    return spec is not None and "--triton-repo" in Path(spec.origin).read_text()


@pytest.fixture(scope="session")
def triton_build(tmp_path_factory) -> Path:
    """A build directory: python -m export.build --fuse --target portable of a random DyT checkpoint (model.fused.onnx,
    the graph TensorRT and Triton's batched step model take; tests/triton/test_generate_backend.py covers the
    default ort-cpu graph),
    with --triton-repo BUILD.parent/build_repo where export.build has that flag;
    export_onnx plus copies where export.build is missing."""
    require("tritonclient.grpc", "the Triton repository tests")
    root = tmp_path_factory.mktemp("triton")
    ckpt = write_checkpoint(root / "ckpt", random_model(seed=3, norm="dyt", max_seq_len=CAPACITY))
    out = root / "build"
    if importlib.util.find_spec("export.build") is not None:
        extra = ["--triton-repo", str(root / "build_repo")] if export_build_has_triton_repo() else []
        proc = subprocess.run([sys.executable, "-m", "export.build", "--fuse", "--target", "portable", "--checkpoint", str(ckpt),
                               "--out", str(out),
                               *extra], capture_output=True, text=True, cwd=REPO, timeout=600)
        assert proc.returncode == 0, f"export.build failed:\n{proc.stderr[-2000:]}"
    else:
        from tests.export.oracle import export_onnx
        from models.checkpoint import load_checkpoint
        out.mkdir()
        export_onnx(load_checkpoint(ckpt), out / "model.onnx")
        for name in ("config.json", "tokenizer.json"):
            shutil.copyfile(ckpt / name, out / name)
    return out


@pytest.fixture(scope="session")
def triton_repo(triton_build, tmp_path_factory) -> Path:
    """The repository, with a stand-in engine file so that decoder_trt is written too
    (its config is checked against the ONNX the engine is built from, never loaded here);
    generate decodes with ort-cpu (auto would pick the engine: trt)."""
    from runtime.triton import write_triton_repository
    root = tmp_path_factory.mktemp("triton_repo")
    engine = root / "model.fused.0123abcd.engine"
    engine.write_bytes(b"ftrt, then not a real engine: the CPU server never loads tensorrt_plan models")
    return write_triton_repository(triton_build, root / "repo", engine=engine, intra_op_threads=1,
                                   generate_backend="ort-cpu")


def infer_input(client_module, name, array, dt):
    """A tritonclient InferInput (http or grpc module) holding `array`."""
    t = client_module.InferInput(name, list(array.shape), dt)
    t.set_data_from_numpy(array)
    return t


def local_and_remote(build, url: str, protocol: str, args: list[str], *client_flags: str):
    """`runtime.generate` on the build and `runtime.triton client` against the server, same args."""
    local = subprocess.run([sys.executable, "-m", "runtime.generate", "--model", str(build), *args],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
    remote = subprocess.run([sys.executable, "-m", "runtime.triton", "client", "--url", url, "--protocol", protocol,
                             *client_flags, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    return local, remote
