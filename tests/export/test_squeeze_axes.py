"""export.onnx_export.explicit_squeeze_axes: axis-less Squeeze gets its axes where the shape is static (TensorRT < 11.5
rejects Squeeze without axes), and the graph computes the same; a symbolic shape is left alone."""
import numpy as np
import onnx
from onnx import TensorProto, helper

from tests.export.oracle import explicit_squeeze_axes
from tests.export.exported import exported
from tests.graph_passes.fixtures import run


def squeeze_model(shape):
    g = helper.make_graph([helper.make_node("Squeeze", ["x"], ["y"], name="sq")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)


def test_static_shape_gets_the_axes_of_its_size_1_dims_and_computes_the_same():
    m = squeeze_model([1, 3, 1, 2])
    x = np.random.default_rng(0).normal(size=(1, 3, 1, 2)).astype(np.float32)
    before = run(m, {"x": x})["y"]
    assert explicit_squeeze_axes(m) == 1
    node = m.graph.node[0]
    axes = next(i for i in m.graph.initializer if i.name == node.input[1])
    assert onnx.numpy_helper.to_array(axes).tolist() == [0, 2]
    after = run(m, {"x": x})["y"]
    assert after.shape == (3, 2) and np.array_equal(before, after)


def test_symbolic_dim_or_explicit_axes_is_left_alone():
    m = squeeze_model(["n", 3, 1])          # n may be 1 at run time: which dims go is not known
    assert explicit_squeeze_axes(m) == 0 and list(m.graph.node[0].input) == ["x"]


def test_exported_graph_has_no_axis_less_squeeze():
    _, proto, _, _ = exported("all-taper")
    squeezes = [n for n in proto.graph.node if n.op_type == "Squeeze"]
    assert squeezes and all(len(n.input) == 2 and n.input[1] for n in squeezes)
