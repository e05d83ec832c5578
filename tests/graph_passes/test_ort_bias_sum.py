"""graph_passes/ort_bias_sum.py: x + (MatMul + bias) becomes one Sum in the ONNX Runtime graph,
equal to the graph before (fp32 tolerance) and to torch; quantizing puts the bias back into
MatMulNBits, bit-equal to quantizing the graph without the Sums."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export.quantize import QuantConfig, quantize_weights
from export.verify import compare, ort_session, read_interface, run_onnx, session_steps, verify_pair
from tests.export.oracle import run_torch
from graph_passes import passes_for, run_passes
from tests.graph_passes.test_ort_attention import _fused_attention_graphs


def _ops(proto) -> list[str]:
    return [n.op_type for n in proto.graph.node]


def test_each_output_projection_bias_and_residual_become_one_sum():
    model, _, gqa, _ = _fused_attention_graphs("internal-taper")       # GPT-2 style: biases on every linear
    out, (result,) = run_passes(gqa, ["ort_bias_sum"])
    n = model.cfg.n_layer
    assert len(result.folded) == 2 * n and not result.skipped, result.notes    # attention out, MLP down
    assert _ops(out).count("Sum") == 2 * n
    assert _ops(out).count("Add") == _ops(gqa).count("Add") - 4 * n            # each Sum replaces two Adds
    verify_pair(gqa, out, tokens=list(range(3, 40)))                          # fp32 atol 1e-4
    iface = read_interface(out)
    steps = session_steps(iface, seed=5, same_start=True)
    compare(run_torch(model, iface, steps), run_onnx(ort_session(out), iface, steps), "fp32", "bias sum vs torch")


def test_a_gqa_build_runs_it_after_the_attention_rewrite():
    names = passes_for("gqa")
    assert names.index("ort_gqa") < names.index("ort_bias_sum") < names.index("trt_lint")
    assert "ort_bias_sum" not in passes_for("fused") and "ort_bias_sum" not in passes_for("plain")


def test_llama_style_layers_without_biases_are_not_candidates():
    _, _, gqa, _ = _fused_attention_graphs("llama-rope")
    out, (result,) = run_passes(gqa, ["ort_bias_sum"])
    assert not result.folded and not result.skipped and _ops(out) == _ops(gqa)


def test_an_add_that_is_not_a_constant_bias_is_left_alone_with_a_note():
    f = TensorProto.FLOAT
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")
    nodes = [helper.make_node("MatMul", ["h", "W"], ["hw"], name="mm"),
             helper.make_node("Add", ["hw", "z"], ["hwz"], name="not_a_bias"),
             helper.make_node("Add", ["x", "hwz"], ["y"], name="residual")]
    io = [helper.make_tensor_value_info(n, f, [1, 2, 4]) for n in ("h", "x")]
    graph = helper.make_graph(nodes, "g", io + [helper.make_tensor_value_info("z", f, [4])],
                              [helper.make_tensor_value_info("y", f, [1, 2, 4])], [w])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    out, (result,) = run_passes(proto, ["ort_bias_sum"])
    assert not result.folded and "not_a_bias" in result.skipped[0].why and "constant bias" in result.skipped[0].why
    assert _ops(out) == ["MatMul", "Add", "Add"]


def test_quantizing_moves_the_bias_into_matmulnbits_bit_equal_to_no_sum():
    _, _, gqa, _ = _fused_attention_graphs("internal-taper")
    summed, _ = run_passes(gqa, ["ort_bias_sum"])
    q_sum, summary = quantize_weights(summed, QuantConfig("int4"))
    q_plain, _ = quantize_weights(gqa, QuantConfig("int4"))
    assert "Sum" not in _ops(q_sum) and [r["pass"] for r in summary.rewritten].count("mnb_bias") == _ops(summed).count("Sum")
    with_bias = [n for n in q_sum.graph.node if n.op_type == "MatMulNBits" and len(n.input) == 6]
    assert len(with_bias) == _ops(summed).count("Sum")
    iface = read_interface(q_sum)
    steps = session_steps(iface, seed=2, same_start=True)
    for opt in (False, True):        # ORT fuses the plain graph's bias Add into MatMulNBits itself
        a = run_onnx(ort_session(q_sum, optimize=opt), iface, steps)
        b = run_onnx(ort_session(q_plain, optimize=opt), iface, steps)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x["logits"], y["logits"])
    onnx.checker.check_model(q_sum)
