"""bf16 builds (export/bfloat16.py, through the one route): the fp32 build's weights rounded to bf16, verified
widened on this CPU, and refused where bf16 cannot run.

The build casts each weight, folded or not, straight to bf16 when it writes it, so every weight of the bf16
graph must be the fp32 graph's weight rounded to bf16, bit for bit; the graph's I/O and caches are bf16; its
own verification (widened copy against the fp32 reference, ATOL_BF16 + SCALE_TOL_BF16) passes, and fails on
a wrong weight.
"""
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.hf_models import hf_model, save_hf

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo"
BF16 = np.dtype(ml_dtypes.bfloat16)


def _folder(source: str, tmp_path: Path) -> Path:
    kind, name = source.split(":")
    return ZOO / name if kind == "zoo" else save_hf(hf_model(name), tmp_path / name)


def _build(folder: Path, out: Path, dtype: str, fuse: bool = True):
    from export.options import BuildOptions
    from export.pipeline import build
    lines = []
    report = build(folder, out, BuildOptions(fuse, dtype), log=lines.append)
    return report, out / ("model.fused.onnx" if fuse else "model.onnx"), lines


def _weights(path: Path) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i, base_dir=str(path.parent)) for i in onnx.load(str(path)).graph.initializer}


def _pair(tmp_path: Path, source: str, fuse: bool):
    """(fp32 weights, bf16 weights, bf16 build's report, its graph) of one checkpoint built both ways."""
    folder = _folder(source, tmp_path)
    _, fp32_path, _ = _build(folder, tmp_path / "fp32", "fp32", fuse)
    report, bf16_path, _ = _build(folder, tmp_path / "bf16", "bf16", fuse)
    return _weights(fp32_path), _weights(bf16_path), report, bf16_path


def _bits(a: np.ndarray) -> np.ndarray:
    return a.astype(BF16).view(np.uint16)


@pytest.mark.parametrize("source, fuse", [
    ("hf:llama", True), ("zoo:internal-taper", False),         # folded; and as trained (the TaperNorm's Mul kept)
    pytest.param("zoo:dyt", True, marks=pytest.mark.slow), pytest.param("hf:gpt2-fakeln", True, marks=pytest.mark.slow),
    pytest.param("zoo:all-taper", True, marks=pytest.mark.slow)])
def test_bf16_build_is_the_fp32_build_rounded_and_verified(tmp_path, source, fuse):
    """Every float weight of the fp32 build is in the bf16 build as bf16: a matrix no pass folded is the fp32
    one rounded once, bit for bit (it never passes through fp16); a folded weight or a vector is within a few
    bf16 steps of the fp32 one; the widened check passed."""
    from core.contract import contract_of
    from export.verify import ATOL, SCALE_TOL
    fp32, bf16, report, bf16_path = _pair(tmp_path, source, fuse)
    assert report.graph == bf16_path.name and report.dtype == "bf16" and bf16_path.is_file()
    assert (report.verification.atol, report.verification.scale_tol) == (ATOL["bf16"], SCALE_TOL["bf16"])
    assert any("widened" in n for n in report.notes)                      # says what ran the check
    assert not list(bf16_path.parent.glob("*.widened.onnx"))               # the checked copy is gone
    assert contract_of(bf16_path).dtype == "bf16"                         # logits and caches
    common = [n for n in fp32 if n in bf16 and fp32[n].dtype == np.float32]
    weights = [n for n in common if bf16[n].dtype == BF16]
    # what stays fp32 is what the fp16 graph keeps fp32: the rope frequencies, a few bytes
    assert sum(fp32[n].nbytes for n in common if n not in weights) < 1024
    untouched = [n for n in weights if fp32[n].ndim == 2 and "__folded" not in n]
    assert untouched and all(np.array_equal(_bits(fp32[n]), bf16[n].view(np.uint16)) for n in untouched)
    for n in weights:                                                      # within 4 bf16 steps of the largest value
        a, b = fp32[n], bf16[n].astype(np.float32)
        finite = np.isfinite(a)                                            # (a mask's -inf stays -inf)
        assert np.array_equal(a[~finite], b[~finite]) and np.isfinite(b[finite]).all(), n
        diff = np.abs(b[finite] - a[finite]).max(initial=0)
        assert diff <= 2.0 ** -6 * np.abs(a[finite]).max(initial=0), (n, diff)
    floats = sum(v.nbytes for v in bf16.values() if v.dtype == BF16)
    assert sum(bf16[n].nbytes for n in weights) >= 0.99 * floats           # the weights, not only a few constants
    assert max(report.verification.graph_vs_torch["random tokens, seed 0"].values()) > 0   # really compared
    from runtime.ort_session import OrtSession
    from runtime.session import ModelFileError
    with pytest.raises(ModelFileError, match="bf16 graph.*TensorRT or --device cuda"):   # refused where it cannot run
        OrtSession(bf16_path).activate()


@pytest.mark.parametrize("source, fuse", [("hf:llama", True)])
def test_every_weight_of_a_bf16_build_is_the_fp32_weight_rounded_once(tmp_path, source, fuse):
    """What the streamed route guaranteed (docs/export.md, "Half precision"): each folded fp32 weight cast to bf16
    once as it is written, so every weight of the bf16 build is the fp32 build's rounded to bf16, bit for bit."""
    fp32, bf16, _, _ = _pair(tmp_path, source, fuse)
    common = [n for n in fp32 if n in bf16 and fp32[n].dtype == np.float32 and bf16[n].dtype == BF16]
    assert [n for n in common if not np.array_equal(_bits(fp32[n]), bf16[n].view(np.uint16))] == []


def test_bf16_verification_fails_on_a_wrong_weight(tmp_path, monkeypatch):
    """A weight written with its sign flipped (a wrong fold would do as much) is caught by the widened check."""
    import graph_passes.lazy as lazy
    from export.verify import VerificationError
    raw_bytes = lazy.raw_bytes

    def flipped(w, value):
        return raw_bytes(w, -value if w.key[0] == "blocks.1.mlp.down_proj.weight" else value)
    monkeypatch.setattr(lazy, "raw_bytes", flipped)
    with pytest.raises(VerificationError, match=r"model.fused.onnx vs torch"):
        _build(ZOO / "internal-taper", tmp_path / "out", "bf16")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_widened_graph_computes_with_the_bf16_weights():
    """A MatMul and a Gather over bf16 initializers, widened: ONNX Runtime's fp32 result equals numpy's
    on the same bf16 values; the table is cast after the Gather (only the gathered rows)."""
    from onnx import TensorProto, helper
    from export.bfloat16 import widen
    from export.verify import ort_session
    rng = np.random.default_rng(0)
    w, table = rng.standard_normal((8, 4)).astype(BF16), rng.standard_normal((50, 8)).astype(BF16)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(table, "table")]
    for t in inits:
        t.data_type = TensorProto.BFLOAT16
    g = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["x"]),
                           helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [3, 4])], inits)
    proto = widen(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert [n.op_type for n in proto.graph.node] == ["Gather", "Cast", "Cast", "MatMul"]
    ids = np.array([3, 0, 49])
    y, = ort_session(proto).run(None, {"ids": ids})
    np.testing.assert_allclose(y, table.astype(np.float32)[ids] @ w.astype(np.float32), rtol=1e-6)
