"""The backend registry: name -> session class, the extra it needs and the devices it takes.

    ort    ONNX Runtime over a build directory (model.fused.onnx, else model.onnx) or an .onnx file
    torch  the reference decoder over a checkpoint directory
    trt    a TensorRT 11 engine built from the build's ONNX (needs the tensorrt extra and CUDA)

tests/runtime/test_backends.py fails when a registered backend has no test module.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path

from runtime.session import DecoderSession, MissingExtraError, RuntimeUsageError


@dataclass(frozen=True)
class Backend:
    name: str
    module: str            # runtime module holding the session class
    cls: str
    requires: str | None   # top-level package that must be importable
    extra: str | None      # tapernorm-deploy extra that installs it
    default_device: str
    devices: tuple[str, ...]   # what --device accepts ("cuda:N": cuda with a device index)


BACKENDS: dict[str, Backend] = {
    "ort": Backend("ort", "runtime.ort_session", "OrtSession", "onnxruntime", None, "cpu", ("cpu", "cuda", "tensorrt")),
    "torch": Backend("torch", "runtime.torch_session", "TorchSession", "torch", None, "cpu", ("cpu", "cuda", "cuda:N")),
    "trt": Backend("trt", "runtime.trt_session", "TrtSession", "tensorrt", "tensorrt", "cuda", ("cuda", "cuda:N")),
}


def require(backend: Backend) -> None:
    """Raise MissingExtraError (one line naming the extra) when the backend's package is missing."""
    if backend.requires is None:
        return
    try:
        importlib.import_module(backend.requires)
    except ImportError:         # absent (ModuleNotFoundError), or installed but failing to load
        raise MissingExtraError(backend.name, backend.extra or "base", backend.requires) from None


def check_device(backend: Backend, device: str) -> str:
    """The device if the backend takes it, else RuntimeUsageError naming the ones it takes."""
    ok = device in backend.devices or ("cuda:N" in backend.devices and re.fullmatch(r"cuda:\d{1,3}", device))
    if not ok:
        raise RuntimeUsageError(f"--device {device!r}: backend {backend.name!r} expected one of "
                                f"{', '.join(backend.devices)}; pass one of those")
    return device


def open_session(name: str, model: str | Path, device: str | None = None, **options) -> DecoderSession:
    """An inactive session of backend `name` over `model`; activate it (or use `with`)."""
    if name not in BACKENDS:
        raise RuntimeUsageError(f"backend {name!r}: expected one of {', '.join(BACKENDS)}; pass one of those")
    backend = BACKENDS[name]
    device = check_device(backend, device or backend.default_device)
    require(backend)
    cls = getattr(importlib.import_module(backend.module), backend.cls)
    return cls(model, device=device, **options)
