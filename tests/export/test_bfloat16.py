"""bf16 builds (export/bfloat16.py, the streamed route): the fp32 build's weights rounded to bf16,
verified widened on this CPU, and refused where bf16 cannot run.

The streamed build casts each folded fp32 weight straight to bf16, so every weight of the bf16
graph must be the fp32 graph's weight rounded to bf16, bit for bit; the graph's I/O and caches
are bf16; its own verification (widened copy against the fp32 reference, ATOL_BF16 +
SCALE_TOL_BF16) passes, and fails on a wrong weight.
"""
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.hf_models import hf_model, save_hf

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo"
REPO = Path(__file__).resolve().parents[2]
BF16 = np.dtype(ml_dtypes.bfloat16)


def _folder(source: str, tmp_path: Path) -> Path:
    kind, name = source.split(":")
    return ZOO / name if kind == "zoo" else save_hf(hf_model(name), tmp_path / name)


def _build(folder: Path, out: Path, dtype: str):
    from export.streamed import build_streamed
    lines = []
    report = build_streamed(folder, out, True, dtype, log=lines.append)
    return report, out / "model.fused.onnx", lines


def _weights(path: Path) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i, base_dir=str(path.parent)) for i in onnx.load(str(path)).graph.initializer}


@pytest.mark.parametrize("source", ["hf:llama", pytest.param("zoo:dyt", marks=pytest.mark.slow), pytest.param("hf:gpt2-fakeln", marks=pytest.mark.slow),
                                    pytest.param("zoo:all-taper", marks=pytest.mark.slow)])
def test_bf16_build_is_the_fp32_build_rounded_and_verified(tmp_path, source):
    from core.contract import contract_of
    from export.verify import ATOL, SCALE_TOL
    folder = _folder(source, tmp_path)
    _, fp32_path, _ = _build(folder, tmp_path / "fp32", "fp32")
    report, bf16_path, lines = _build(folder, tmp_path / "bf16", "bf16")
    assert (report.atol, report.scale_tol) == (ATOL["bf16"], SCALE_TOL["bf16"])
    assert any("widened" in n for n in report.notes)                      # says what ran the check
    assert not list(bf16_path.parent.glob("*.widened.onnx"))               # the checked copy is gone
    assert contract_of(bf16_path).dtype == "bf16"                         # logits and caches
    fp32, bf16 = _weights(fp32_path), _weights(bf16_path)
    common = [n for n in fp32 if n in bf16 and fp32[n].dtype == np.float32]
    assert all(bf16[n].dtype == BF16 for n in common)
    for n in common:                                                       # rounded once, from the fp32 fold
        assert np.array_equal(fp32[n].astype(BF16).view(np.uint16), bf16[n].view(np.uint16)), n
    floats = sum(v.nbytes for v in bf16.values() if v.dtype == BF16)
    assert sum(bf16[n].nbytes for n in common) >= 0.99 * floats            # the weights, not only a few constants
    assert max(report.max_abs_diff["graph_vs_torch"]["random tokens, seed 0"].values()) > 0   # really compared
    from runtime.ort_session import OrtSession
    from runtime.session import ModelFileError
    with pytest.raises(ModelFileError, match="bf16 graph.*TensorRT or --device cuda"):   # refused where it cannot run
        OrtSession(bf16_path).activate()


def test_bf16_verification_fails_on_a_wrong_weight(tmp_path, monkeypatch):
    """A weight with its sign flipped (a wrong fold would do as much) is caught by the widened check."""
    import export.stream as stream
    from export.verify import VerificationError
    rows_value = stream._rows_value

    def flipped(recipe, tensors, np_dtype):
        x = rows_value(recipe, tensors, np_dtype)
        return -x if recipe.params == ["blocks.1.mlp.down_proj.weight"] else x
    monkeypatch.setattr(stream, "_rows_value", flipped)
    with pytest.raises(VerificationError):
        _build(ZOO / "internal-taper", tmp_path / "out", "bf16")
    assert not (tmp_path / "out").exists()


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


def test_bf16_is_refused_by_the_in_memory_route(tmp_path):
    """(ONNX Runtime's CPU refusing a bf16 graph: test_bf16_build_is_the_fp32_build_rounded_and_verified.)"""
    proc = subprocess.run([sys.executable, "-m", "export.build", "--fuse", "--dtype", "bf16", "--route", "in-memory",
                           "--out", str(tmp_path / "b")], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "--route streamed" in proc.stderr and not (tmp_path / "b").exists()
    assert len(proc.stderr.strip().splitlines()) == 1


def test_what_the_streamed_build_cannot_plan_names_options_export_build_has():
    """Its fix named `--stream`, which export.build has never had (--route picks the build)."""
    import re
    from export.stream import ELSEWHERE
    from tests.cli.conftest import cli
    named = set(re.findall(r"--[a-z][a-z-]*", ELSEWHERE))
    assert named == {"--route", "--fuse"}
    helped = cli("export.build", ["--help"]).out
    assert all(re.search(rf"{o}\b", helped) for o in named), helped
    assert "--stream " not in helped and "--stream]" not in helped
