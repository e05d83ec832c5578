"""The backend registry: name -> session class, the extra it needs and what --model names.

    ort    ONNX Runtime over a build directory (model.fused.onnx, else model.onnx) or an .onnx file
    torch  the reference decoder over a checkpoint directory
    trt    a TensorRT 11 engine built from the build's ONNX (needs the tensorrt extra and CUDA)

tests/runtime/test_backends.py fails when a registered backend has no test module.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from runtime.session import DecoderSession, MissingExtraError


@dataclass(frozen=True)
class Backend:
    name: str
    module: str            # runtime module holding the session class
    cls: str
    requires: str | None   # top-level package that must be importable
    extra: str | None      # tapernorm-deploy extra that installs it
    model_kind: str        # what --model points at
    default_device: str


BACKENDS: dict[str, Backend] = {
    "ort": Backend("ort", "runtime.ort_session", "OrtSession", "onnxruntime", None,
                   "a build directory or an .onnx file", "cpu"),
    "torch": Backend("torch", "runtime.torch_session", "TorchSession", "torch", None,
                     "a checkpoint directory", "cpu"),
    "trt": Backend("trt", "runtime.trt_session", "TrtSession", "tensorrt", "tensorrt",
                   "a build directory or an .onnx file", "cuda"),
}


def require(backend: Backend) -> None:
    """Raise MissingExtraError (one line naming the extra) when the backend's package is missing."""
    if backend.requires is None:
        return
    try:
        found = importlib.util.find_spec(backend.requires) is not None
        if found:
            importlib.import_module(backend.requires)
    except ImportError:
        found = False
    if not found:
        raise MissingExtraError(backend.name, backend.extra or "base", backend.requires)


def open_session(name: str, model: str | Path, device: str | None = None, **options) -> DecoderSession:
    """An inactive session of backend `name` over `model`; activate it (or use `with`)."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r}; expected one of {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    require(backend)
    cls = getattr(importlib.import_module(backend.module), backend.cls)
    return cls(model, device=device or backend.default_device, **options)
