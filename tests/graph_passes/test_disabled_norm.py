"""disabled_norm: a norm with eps >= 1e6 folds completely (centering included); must-not-rewrite cases."""
import numpy as np
import pytest
from onnx import helper

from graph_passes import run_passes
from graph_passes.disabled_norm import DISABLED_NORM_EPS
from tests.graph_passes.fixtures import D, assert_same, init, model, ops, rng_mat, rng_vec, x_feed

PASS = ["disabled_norm"]
EPS = 1e12   # what LN-free GPT-2 checkpoints carry


def norm_graph(op="LayerNormalization", eps=EPS, beta=True, consumer=None, gain=1e6):
    """x ─▶ Norm(x, gamma * gain, beta, epsilon=eps) ─┬─▶ MatMul(W0) ▶ Add(b0)
                                                      └─▶ MatMul(W1)"""
    ins = ["x", "g"] + (["b"] if op == "LayerNormalization" and beta else [])
    nodes = [helper.make_node(op, ins, ["n"], name="ln", axis=-1, epsilon=eps),
             helper.make_node("MatMul", ["n", "W0"], ["m0"], name="q"),
             helper.make_node("Add", ["m0", "b0"], ["y0"], name="q_bias"),
             helper.make_node("MatMul", ["n", "W1"], ["y1"], name="k")]
    outs = ["y0", "y1"]
    if consumer:
        nodes.append(helper.make_node(consumer, ["n"], ["z"], name="other"))
        outs.append("z")
    inits = [init("W0", rng_mat(1)), init("W1", rng_mat(2)), init("b0", rng_vec(3, 6, 0.0)),
             init("g", rng_vec(4) * np.float32(gain))]
    if "b" in ins:
        inits.append(init("b", rng_vec(5, loc=0.0)))
    return model(nodes, inits, outputs=outs)


def test_threshold_agrees_with_the_checkpoint_format():
    from models.checkpoint import DISABLED_NORM_EPS as CHECKPOINT_EPS
    assert DISABLED_NORM_EPS == CHECKPOINT_EPS


@pytest.mark.parametrize("op,beta", [("LayerNormalization", True), ("LayerNormalization", False),
                                     ("RMSNormalization", False)])
def test_disabled_norm_disappears_and_matches(op, beta):
    m = norm_graph(op, beta=beta)
    fused, (res,) = run_passes(m, PASS)
    assert len(res.rewrites) == 1 and op not in ops(fused)
    assert sorted(ops(fused)) == sorted(["MatMul", "Add", "MatMul"] + (["Add"] if beta else []))
    # x with a non-zero mean per token: the centering must be folded, not dropped
    feeds = {"x": (np.random.default_rng(0).normal(size=(2, 3, D)) + 3.0).astype(np.float32)}
    assert_same(m, fused, feeds, atol=1e-5)


def test_centering_is_what_makes_it_exact():
    """Without C the fold would be off by mean(x) * s @ W: a large-mean input shows it."""
    m = norm_graph()
    fused, _ = run_passes(m, PASS)
    feeds = {"x": (np.random.default_rng(1).normal(size=(2, 3, D)) + 100.0).astype(np.float32)}
    assert_same(m, fused, feeds, atol=1e-4)


def test_ordinary_eps_is_not_touched():
    m = norm_graph(eps=1e-5, gain=1.0)
    fused, (res,) = run_passes(m, PASS)
    assert res.rewrites == [] and res.notes == [] and sorted(ops(fused)) == sorted(ops(m))


def test_no_rewrite_when_the_norm_feeds_a_non_linear_consumer():
    m = norm_graph(consumer="Relu")
    fused, (res,) = run_passes(m, PASS)
    assert res.rewrites == [] and sorted(ops(fused)) == sorted(ops(m))
    assert any("ln" in n and "Relu" in n for n in res.notes), res.notes
    assert_same(m, fused)
