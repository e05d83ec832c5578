"""core.onnx_writer's byte counts on graphs built in code (no exporter)."""
import numpy as np
from onnx import TensorProto, helper, numpy_helper

from core.onnx_writer import initializer_bytes


def _graph():
    """E [8, 4] read by Gather only (a lookup table), W [4, 4] by MatMul, T [8, 4] by Gather and MatMul (tied)."""
    inits = [numpy_helper.from_array(np.zeros((8, 4), np.float32), n) for n in ("E", "T")]
    inits.append(numpy_helper.from_array(np.zeros((4, 4), np.float32), "W"))
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"]), helper.make_node("Gather", ["T", "ids"], ["t"]),
             helper.make_node("MatMul", ["e", "W"], ["h"]), helper.make_node("MatMul", ["h", "T"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g)


def test_per_step_bytes_leave_out_tables_read_only_by_lookups():
    proto = _graph()
    assert initializer_bytes(proto) == (32 + 32 + 16) * 4
    assert initializer_bytes(proto, per_step=True) == (32 + 16) * 4       # E is read a row a token
