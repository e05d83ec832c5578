"""dyt_affine: numerical before/after and must-not-rewrite cases."""
import pytest
from onnx import helper

from graph_passes import run_passes
from tests.graph_passes.fixtures import D, assert_same, init, model, ops, rng_mat, rng_vec

PASS = ["dyt_affine"]


def dyt_graph(beta=True, consumer=None, gamma_shape=(D,), gamma_first=True):
    g_in = ["g", "t"] if gamma_first else ["t", "g"]
    nodes = [helper.make_node("Mul", ["x", "alpha"], ["a"], name="dyt_alpha"),
             helper.make_node("Tanh", ["a"], ["t"], name="dyt_tanh"),
             helper.make_node("Mul", g_in, ["gt"], name="dyt_gamma")]
    h = "gt"
    if beta:
        nodes.append(helper.make_node("Add", ["gt", "b"], ["h"], name="dyt_beta"))
        h = "h"
    nodes += [helper.make_node("MatMul", [h, "W0"], ["m0"], name="up"),
              helper.make_node("Add", ["m0", "b0"], ["y0"], name="up_bias")]
    outs = ["y0"]
    if consumer:
        nodes.append(helper.make_node(consumer, [h], ["z"], name="other"))
        outs.append("z")
    inits = [init("alpha", rng_vec(1, 1, 0.7).reshape(())), init("g", rng_vec(2).reshape(gamma_shape)),
             init("b", rng_vec(3, loc=0.0)), init("W0", rng_mat(4)), init("b0", rng_vec(5, 6, 0.0))]
    return model(nodes, inits, outputs=outs)


@pytest.mark.parametrize("beta,gamma_first", [(True, True), (False, True), (True, False)])
def test_dyt_gamma_beta_fold_numerically(beta, gamma_first):
    m = dyt_graph(beta, gamma_first=gamma_first)
    fused, (res,) = run_passes(m, PASS)
    assert len(res.rewrites) == 1
    assert ops(fused) == ["Mul", "Tanh", "MatMul", "Add"]
    assert_same(m, fused)


def test_no_rewrite_when_dyt_feeds_a_non_matmul():
    m = dyt_graph(consumer="Relu")
    fused, (res,) = run_passes(m, PASS)
    assert res.rewrites == [] and sorted(ops(fused)) == sorted(ops(m))
    assert_same(m, fused)


def test_no_rewrite_on_wrong_axis_gamma():
    m = dyt_graph(gamma_shape=(D, 1))
    m.graph.node[1].input[0] = "x"
    fused, (res,) = run_passes(m, PASS)
    assert res.rewrites == [] and any("per-channel" in n for n in res.notes)


def test_taper_pass_leaves_dyt_alone_in_a_foreign_graph():
    m = dyt_graph()
    fused, (res,) = run_passes(m, ["taper_scale"])
    assert res.rewrites == []
    # ... but the alpha Mul (before the Tanh) is not foldable either: it feeds a Tanh
    assert sorted(ops(fused)) == sorted(ops(m))
