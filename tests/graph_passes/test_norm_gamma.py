"""norm_gamma (FlashNorm): numerical before/after and must-not-rewrite cases."""
import numpy as np
import pytest
from onnx import helper, numpy_helper

from graph_passes import run_passes
from tests.graph_passes.fixtures import D, assert_same, init, model, ops, rng_mat, rng_vec, x_feed

PASS = ["norm_gamma"]


def norm_graph(op="RMSNormalization", beta=True, axis=-1, consumer="MatMul", gamma_const=True):
    ins = ["x", "g"] + (["b"] if op == "LayerNormalization" and beta else [])
    nodes = [helper.make_node(op, ins, ["n"], name="ln", axis=axis, epsilon=1e-5),
             helper.make_node("MatMul", ["n", "W0"], ["m0"], name="q"),
             helper.make_node("Add", ["m0", "b0"], ["y0"], name="q_bias"),
             helper.make_node("MatMul", ["n", "W1"], ["y1"], name="k")]
    outs = ["y0", "y1"]
    if consumer != "MatMul":
        nodes.append(helper.make_node(consumer, ["n"], ["z"], name="other"))
        outs.append("z")
    inits = [init("W0", rng_mat(1)), init("W1", rng_mat(2)), init("b0", rng_vec(3, 6, 0.0))]
    if gamma_const:
        inits.append(init("g", rng_vec(4)))
    if "b" in ins:
        inits.append(init("b", rng_vec(5, loc=0.0)))
    m = model(nodes, inits, outputs=outs)
    if not gamma_const:
        m.graph.input.append(helper.make_tensor_value_info("g", 1, [D]))
    return m


@pytest.mark.parametrize("op,beta", [("RMSNormalization", False), ("LayerNormalization", True),
                                     ("LayerNormalization", False)])
def test_gamma_and_beta_fold_numerically(op, beta):
    m = norm_graph(op, beta)
    fused, (res,) = run_passes(m, PASS)
    assert len(res.rewrites) == 1 and ops(fused).count(op) == 1
    norm = next(n for n in fused.graph.node if n.op_type == op)
    assert len(norm.input) == 2
    gamma = next(i for i in fused.graph.initializer if i.name == norm.input[1])
    np.testing.assert_array_equal(numpy_helper.to_array(gamma), np.ones(D, np.float32))
    assert_same(m, fused)


def test_second_run_is_a_no_op():
    fused, _ = run_passes(norm_graph(), PASS)
    again, (res,) = run_passes(fused, PASS)
    assert res.rewrites == []


def test_no_rewrite_when_norm_feeds_a_non_matmul():
    m = norm_graph(consumer="Relu")
    fused, (res,) = run_passes(m, PASS)
    assert res.rewrites == [] and any("Relu" in n for n in res.notes)
    assert_same(m, fused)


def test_no_rewrite_on_another_axis():
    m = norm_graph("LayerNormalization", axis=1)
    m.graph.node[1].input[1] = "W0"
    fused, (res,) = run_passes(m, PASS)
    assert res.rewrites == [] and any("axis 1" in n for n in res.notes)


def test_no_rewrite_when_gamma_is_not_constant():
    m = norm_graph(gamma_const=False)
    fused, (res,) = run_passes(m, PASS)
    assert res.rewrites == [] and any("not a constant" in n for n in res.notes)
    feeds = {**x_feed(), "g": rng_vec(8)}
    from tests.graph_passes.fixtures import run
    np.testing.assert_allclose(run(fused, feeds)["y0"], run(m, feeds)["y0"], atol=1e-6)


def skip_norm_graph(op="SkipLayerNormalization", beta=True, bias=True):
    """ONNX Runtime's fused residual + norm (its transformers optimizer writes it):

        x, skip ─▶ SkipLayerNormalization(x, skip, gamma, beta, bias) ─┬─ out ─▶ MatMul(W0), MatMul(W1)
                                                                       └─ sum (residual, output 3) ─▶ graph output
    """
    ins = ["x", "skip", "g"]
    if op == "SkipLayerNormalization":
        ins += ["b" if beta else "", "bias" if bias else ""]
    elif bias:
        ins += ["bias"]
    nodes = [helper.make_node(op, ins, ["n", "", "", "sum"], name="skip_ln", domain="com.microsoft", epsilon=1e-5),
             helper.make_node("MatMul", ["n", "W0"], ["y0"], name="q"),
             helper.make_node("MatMul", ["n", "W1"], ["y1"], name="k")]
    inits = [init("W0", rng_mat(1)), init("W1", rng_mat(2)), init("g", rng_vec(4)), init("b", rng_vec(5, loc=0.0)),
             init("bias", rng_vec(6, loc=0.0))]
    m = model(nodes, [i for i in inits if i.name in ins or i.name.startswith("W")], outputs=("y0", "y1", "sum"),
              inputs=(("x", [2, 3, D]), ("skip", [2, 3, D])))
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return m


@pytest.mark.parametrize("op,beta,bias", [("SkipLayerNormalization", True, True), ("SkipLayerNormalization", True, False),
                                          ("SkipSimplifiedLayerNormalization", False, True)])
def test_ort_skip_norms_are_gamma_folded_and_kept(op, beta, bias):
    m = skip_norm_graph(op, beta, bias)
    fused, (res,) = run_passes(m, PASS)
    assert len(res.rewrites) == 1 and ops(fused).count(op) == 1
    norm = next(n for n in fused.graph.node if n.op_type == op)
    gamma = next(i for i in fused.graph.initializer if i.name == norm.input[2])
    assert np.all(numpy_helper.to_array(gamma) == 1)
    if op == "SkipLayerNormalization":
        assert len(norm.input) < 4 or norm.input[3] == ""          # beta dropped, the bias kept
        assert (len(norm.input) == 5 and norm.input[4] == "bias") == bias
    feeds = {**x_feed(), "skip": x_feed(1)["x"]}
    assert_same(m, fused, feeds)
