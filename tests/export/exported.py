"""Exports shared by the export tests: each kind is exported and fused once per test session."""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import onnx

from tests.export.oracle import export_onnx
from graph_passes import run_passes
from tests.helpers import random_model

KINDS = {
    "internal-taper": dict(norm="taper", taper_scope="internal", gate=0.0),
    "all-taper": dict(norm="taper", taper_scope="all", gate=0.0),
    "all-taper-affine-ln-swiglu-untied": dict(norm="taper", taper_scope="all", taper_base="ln", taper_affine=True,
                                              mlp="swiglu", tie_embeddings=False, gate=0.0),
    "baseline": dict(norm="rmsnorm"),
    "layernorm": dict(norm="layernorm"),
    "dyt": dict(norm="dyt"),
}
_DIR = Path(tempfile.mkdtemp(prefix="export-tests-"))
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)     # each test process made one and left it behind


@functools.lru_cache(maxsize=None)
def exported(kind: str, dtype: str = "fp32"):
    """(model, unfused proto, fused proto, pass results)."""
    model = random_model(seed=len(kind), **KINDS[kind])
    path = _DIR / f"{kind}.{dtype}.onnx"
    proto = export_onnx(model, path, dtype)
    fused, results = run_passes(proto)
    return model, proto, fused, results


def save(proto: onnx.ModelProto, name: str) -> Path:
    path = _DIR / name
    onnx.save(proto, path)
    return path
