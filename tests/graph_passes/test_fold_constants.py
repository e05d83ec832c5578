"""fold_constants: a scale computed from initializers becomes one constant the folds can read."""
from onnx import helper

from graph_passes import run_passes
from tests.graph_passes.fixtures import assert_same, init, model, ops, rng_mat, rng_vec


def computed_scale_graph():
    # s = c * gamma_tilde computed in the graph (as a non-folding exporter writes it)
    nodes = [helper.make_node("Mul", ["c", "gt"], ["s"], name="scale_calc"),
             helper.make_node("Mul", ["x", "s"], ["h"], name="taper_mul"),
             helper.make_node("MatMul", ["h", "W"], ["y"], name="q")]
    return model(nodes, [init("c", rng_vec(1, 1).reshape(())), init("gt", rng_vec(2)), init("W", rng_mat(3))])


def test_constant_subgraph_folds_then_scale_folds():
    m = computed_scale_graph()
    fused, (fc, ts) = run_passes(m, ["fold_constants", "channel_scale"])
    assert len(fc.rewrites) == 1 and len(ts.rewrites) == 1
    assert ops(fused) == ["MatMul"]
    assert_same(m, fused)


def test_without_folding_first_the_scale_is_not_a_constant():
    m = computed_scale_graph()
    fused, (ts,) = run_passes(m, ["channel_scale"])
    assert ts.rewrites == [] and ops(fused) == ops(m)


def test_nothing_to_fold_is_no_rewrite():
    m = model([helper.make_node("Relu", ["x"], ["y"], name="r")], [])
    _, (fc,) = run_passes(m, ["fold_constants"])
    assert fc.rewrites == []
