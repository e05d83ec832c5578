"""export.quant_reference.dequantize against ONNX Runtime's own kernels on the quantizer's output.

The streamed build verifies a quantized graph against a torch model holding dequantize()'s weights,
so dequantize() must be what MatMulNBits / GatherBlockQuantized compute from the same blocks. Each
kernel is run on a one-node graph that ONNX Runtime's quantizer made, with inputs that read every
weight back: the identity matrix through MatMulNBits (accuracy level 0: fp32 arithmetic), every
row index through GatherBlockQuantized.
"""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from export.quant_reference import dequantize
from export.quantize import QuantConfig, algo_config, quiet_quantizer


def _quantized_graph_output(op: str, w: np.ndarray, cfg: QuantConfig) -> np.ndarray:
    """What ONNX Runtime computes from its quantizer's blocks of w: MatMul x @ w with x = I [K, K]
    (-> w as the kernel sees it, [K, N]); Gather of every row of the table w [V, d]."""
    if op == "Gather":
        node, feed = helper.make_node("Gather", ["W", "ids"], ["y"], name="one"), np.arange(w.shape[0])
        x = helper.make_tensor_value_info("ids", TensorProto.INT64, [w.shape[0]])
    else:
        node, feed = helper.make_node("MatMul", ["x", "W"], ["y"], name="one"), np.eye(w.shape[0], dtype=np.float32)
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(feed.shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    g = helper.make_graph([node], "one", [x], [y], [numpy_helper.from_array(w, "W")])
    with quiet_quantizer():
        q = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]),
                                 algo_config=algo_config(cfg, (op,)))
        q.process()
    assert {n.op_type for n in q.model.model.graph.node} & {"MatMulNBits", "GatherBlockQuantized"}
    sess = ort.InferenceSession(q.model.model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: feed})[0]


@pytest.mark.parametrize("dtype,k", [("int4", 96), ("int4", 100), ("int8", 64)])
def test_dequantized_matmul_weight_is_what_matmulnbits_computes(dtype, k):
    w = np.random.default_rng(0).standard_normal((k, 48)).astype(np.float32)           # [K, N]
    cfg = QuantConfig(dtype, 32, accuracy_level=0)
    ours = dequantize(w, "MatMul", cfg.bits, cfg)                                        # [N, K]
    kernel = _quantized_graph_output("MatMul", w, cfg)                                  # [K, N]
    assert ours.shape == (48, k)
    np.testing.assert_allclose(ours.T, kernel, rtol=0, atol=1e-6 * np.abs(w).max())
    assert np.abs(ours.T - w).max() > 1e-3            # quantized: not the float weight handed back


def test_dequantized_tied_table_as_a_matmul_weight_and_as_a_gather_table():
    table = np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32)     # E [V, d]
    cfg = QuantConfig("int4", 32, accuracy_level=0)
    as_head = dequantize(table, "MatMulT", 4, cfg)                                       # E's layout [V, d]
    np.testing.assert_allclose(as_head, _quantized_graph_output("MatMul", np.ascontiguousarray(table.T), cfg).T,
                               rtol=0, atol=1e-6 * np.abs(table).max())
    as_table = dequantize(table, "Gather", 4, cfg)                                       # [V, d]
    np.testing.assert_allclose(as_table, _quantized_graph_output("Gather", table, cfg),
                               rtol=0, atol=1e-6 * np.abs(table).max())
