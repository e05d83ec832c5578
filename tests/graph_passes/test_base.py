"""The driver and shared helpers: provenance names, per-channel vectors, metadata round trip."""
import numpy as np
from onnx import helper

from graph_passes import run_passes
from graph_passes.base import channel_vector, const_value, load_graph
from tests.graph_passes.fixtures import model, scale_to_linears


def test_layer_name_strips_the_wrapper_and_falls_back_to_the_node_name():
    ctx = load_graph(scale_to_linears(shift=np.zeros(8, np.float32)))
    mul = next(n for n in ctx.graph.nodes if n.op == "Mul")
    assert ctx.layer_name(mul) == "blocks.0.ln_1"
    mm = next(n for n in ctx.graph.nodes if n.op == "MatMul")
    assert ctx.layer_name(mm) == mm.name and not ctx.has_provenance(mm)


def test_channel_vector_accepts_only_last_axis_broadcasts():
    assert channel_vector(np.ones(4, np.float32)).shape == (4,)
    assert channel_vector(np.ones((1, 1, 4), np.float32)).shape == (4,)
    assert channel_vector(np.float32(2.0).reshape(())).shape == (1,)
    assert channel_vector(np.ones((4, 1), np.float32)) is None
    assert channel_vector(np.ones((2, 4), np.float32)) is None
    assert channel_vector(np.ones(4, np.int64)) is None


def test_const_value_reads_constant_nodes():
    m = model([helper.make_node("Constant", [], ["c"], name="k", value=helper.make_tensor("v", 1, [2], [1.0, 2.0])),
               helper.make_node("Mul", ["x", "c"], ["y"], name="m")], [], inputs=(("x", [2]),))
    ctx = load_graph(m)
    mul = next(n for n in ctx.graph.nodes if n.op == "Mul")
    np.testing.assert_array_equal(const_value(mul.inputs[1]), [1.0, 2.0])
    assert const_value(mul.inputs[0]) is None


def test_metadata_survives_the_passes():
    m = scale_to_linears()
    m.graph.node[1].metadata_props.add(key="note", value="kept")
    fused, _ = run_passes(m, ["taper_scale"])
    assert {p.key: p.value for p in fused.metadata_props} == {"tapernorm.gate": "0.0"}
    kept = {n.name: {p.key: p.value for p in n.metadata_props} for n in fused.graph.node}
    assert kept[m.graph.node[1].name] == {"note": "kept"}
