"""trt_lint: flags what the TensorRT 11 ONNX parser rejects; --strict exits non-zero."""
import subprocess
import sys

import numpy as np
import onnx
from onnx import helper

from graph_passes import run_passes
from tests.graph_passes.fixtures import D, init, model, scale_to_linears


def lint(m):
    _, (res,) = run_passes(m, ["trt_lint"])
    return res.notes


def test_clean_graph_has_no_issues():
    assert lint(scale_to_linears()) == []


def test_if_producing_a_graph_output_is_flagged():
    branch = lambda name: helper.make_graph([helper.make_node("Identity", ["x"], [f"o_{name}"])], name, [],
                                            [helper.make_tensor_value_info(f"o_{name}", 1, None)])
    nodes = [helper.make_node("ReduceSum", ["x"], ["r"], keepdims=0, name="sum"),
             helper.make_node("Cast", ["r"], ["cond"], to=onnx.TensorProto.BOOL, name="cast"),
             helper.make_node("If", ["cond"], ["y"], name="merged", then_branch=branch("a"), else_branch=branch("b"))]
    notes = lint(model(nodes, []))
    assert any("merged (If)" in n and "graph output" in n for n in notes)


def test_attention_with_past_and_unsupported_op_and_dtype():
    nodes = [helper.make_node("Attention", ["x", "x", "x", "", "pk", "pv"], ["y", "present_k", "present_v"], name="attn"),
             helper.make_node("GroupQueryAttention", ["x"], ["z"], name="gqa", domain="com.microsoft"),
             helper.make_node("Cast", ["x"], ["d"], to=onnx.TensorProto.DOUBLE, name="to64")]
    m = model(nodes, [init("pk", np.zeros((2, 1, 1, D), np.float32)), init("pv", np.zeros((2, 1, 1, D), np.float32))],
              outputs=("y", "z", "d"))
    notes = lint(m)
    assert any("attn (Attention)" in n and "past/present" in n for n in notes)
    assert any("gqa" in n and "com.microsoft" in n for n in notes)
    assert any("float64" in n for n in notes)


def test_cli_strict_exit_code(tmp_path):
    m = model([helper.make_node("Cast", ["x"], ["y"], to=onnx.TensorProto.DOUBLE, name="to64")], [])
    src = tmp_path / "in.onnx"
    onnx.save(m, src)
    cmd = [sys.executable, "-m", "graph_passes", str(src), "-o", str(tmp_path / "out.onnx"), "--passes", "trt_lint"]
    lenient = subprocess.run(cmd, capture_output=True, text=True)
    strict = subprocess.run(cmd + ["--strict"], capture_output=True, text=True)
    assert lenient.returncode == 0 and "float64" in lenient.stdout
    assert strict.returncode == 1 and strict.stderr.startswith("error: ") and "1 TensorRT parser issue" in strict.stderr
