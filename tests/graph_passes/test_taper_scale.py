"""taper_scale: numerical before/after (ORT optimizations off) and must-not-rewrite cases."""
import numpy as np
import onnx
import pytest
from onnx import helper

from graph_passes import PassError, run_passes
from graph_passes.taper_scale import detect_taper
from graph_passes.base import load_graph
from tests.graph_passes.fixtures import (D, OUT, assert_same, init, model, ops, rng_mat, rng_vec, run,
                                         scale_to_linears, taper_meta, x_feed)

PASS = ["taper_scale"]


@pytest.mark.parametrize("kw", [
    {}, {"shift": rng_vec(5, loc=0.0)}, {"bias": False}, {"bias": False, "shift": rng_vec(5, loc=0.0)},
    {"n_linear": 1},
], ids=["scale", "affine", "nobias", "nobias-affine", "one-linear"])
def test_fold_matches_numerically(kw):
    m = scale_to_linears(**kw)
    fused, (res,) = run_passes(m, PASS)
    assert len(res.rewrites) == 1
    assert "Mul" not in ops(fused)
    n_bias = kw.get("n_linear", 3) if kw.get("bias", True) or "shift" in kw else 0
    assert ops(fused).count("Add") == n_bias  # only the linear biases remain
    assert_same(m, fused)


def test_fold_into_gemm_transb_alpha_beta():
    m = scale_to_linears(gemm=True, shift=rng_vec(5, loc=0.0))
    fused, (res,) = run_passes(m, PASS)
    assert ops(fused) == ["Gemm"] * 3 and len(res.rewrites) == 1
    assert_same(m, fused, x_feed(shape=(6, D)))


def _tied_head_graph():
    """Embedding Gather and LM head share one table E [V, D]: x ─▶ Mul(s) ─▶ MatMul(Transpose(E))."""
    v = 11
    emb = rng_mat(3, (v, D))
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"], name="wte"),
             helper.make_node("Add", ["x", "e"], ["x2"], name="resid"),
             helper.make_node("Mul", ["x2", "s"], ["h"], name="ln_f_mul"),
             helper.make_node("Transpose", ["E"], ["Et"], name="head_t", perm=[1, 0]),
             helper.make_node("MatMul", ["h", "Et"], ["logits"], name="lm_head")]
    m = model(nodes, [init("E", emb), init("s", rng_vec(4))], outputs=("logits",),
              inputs=(("x", [2, 3, D]),), meta={"tapernorm.gate": "0.0"},
              node_meta={"ln_f_mul": taper_meta("ln_f")})
    m.graph.input.append(helper.make_tensor_value_info("ids", 7, [2, 3]))
    return m, emb


def test_tied_head_is_cloned_and_embedding_untouched():
    m, emb = _tied_head_graph()
    feeds = {**x_feed(), "ids": np.array([[1, 2, 3], [4, 5, 10]], dtype=np.int64)}
    fused, (res,) = run_passes(m, PASS)
    assert res.rewrites == [("ln_f", "scale -> lm_head")]
    table = next(i for i in fused.graph.initializer if i.name == "E")
    np.testing.assert_array_equal(np.frombuffer(table.raw_data, np.float32).reshape(emb.shape), emb)
    assert "Mul" not in ops(fused)
    assert_same(m, fused, feeds)


def test_shared_weight_keeps_original_for_unrewritten_node():
    """W0 also feeds a MatMul that reads the unscaled x: it must still see the original W0."""
    m = scale_to_linears(n_linear=2)
    m.graph.node.append(helper.make_node("MatMul", ["x", "W0"], ["other"], name="other_mm"))
    m.graph.output.append(helper.make_tensor_value_info("other", 1, None))
    fused, (res,) = run_passes(m, PASS)
    assert len(res.rewrites) == 1
    assert "W0" in {i.name for i in fused.graph.initializer}   # the original, still used, unchanged
    assert_same(m, fused)


# --- must not rewrite ----------------------------------------------------------------

def _unchanged(m, note_part=None):
    fused, (res,) = run_passes(m, PASS)
    assert res.rewrites == []
    assert sorted(ops(fused)) == sorted(ops(m))
    if note_part:
        assert any(note_part in n for n in res.notes), res.notes
    assert_same(m, fused)


def test_no_rewrite_when_scale_feeds_a_non_matmul():
    _unchanged(scale_to_linears(extra_consumer="Relu"), "Relu")


def test_no_rewrite_when_scale_is_not_constant():
    m = scale_to_linears()
    m.graph.initializer.remove(next(i for i in m.graph.initializer if i.name == "s"))
    m.graph.input.append(helper.make_tensor_value_info("s", 1, [D]))
    fused, (res,) = run_passes(m, PASS)
    assert res.rewrites == [] and "Mul" in ops(fused)
    assert any("not a constant" in n for n in res.notes)
    feeds = {**x_feed(), "s": rng_vec(9)}
    np.testing.assert_allclose(run(fused, feeds)["y0"], run(m, feeds)["y0"], atol=1e-6)


def test_no_rewrite_on_wrong_axis():
    # s of shape [3, 1] scales the token axis of x [2, 3, D], not the channels
    m = scale_to_linears(scale=rng_vec(1, n=3), scale_shape=(3, 1))
    _unchanged(m, "not per-channel")


def test_no_rewrite_when_scaled_tensor_is_a_graph_output():
    m = scale_to_linears()
    m.graph.output.append(helper.make_tensor_value_info("h", 1, None))
    _unchanged(m, "graph output")


def test_no_rewrite_when_scaled_tensor_is_the_weight_operand():
    nodes = [helper.make_node("Mul", ["x", "s"], ["h"], name="ln_mul"),
             helper.make_node("MatMul", ["W", "h"], ["y"], name="mm")]
    m = model(nodes, [init("s", rng_vec(1)), init("W", rng_mat(2, (OUT, 3)))], meta={"tapernorm.gate": "0.0"},
              node_meta={"ln_mul": taper_meta("blocks.0.ln_1")})
    _unchanged(m, "weight")


def test_a_graph_without_provenance_is_left_to_channel_scale():
    m = scale_to_linears(meta=False)
    fused, (res,) = run_passes(m, PASS)
    assert res.rewrites == [] and res.notes == [] and "Mul" in ops(fused)


def test_no_rewrite_of_a_non_taper_mul_in_a_torch_graph():
    m = scale_to_linears()
    for p in m.graph.node[0].metadata_props:
        if p.key.endswith("class_hierarchy"):
            p.value = repr(["models.decoder.MLP", "aten.mul.Tensor"])
    _unchanged(m)


# --- gate detection ----------------------------------------------------------

def test_gate_above_zero_is_refused_with_layers_named():
    m = scale_to_linears()
    m.metadata_props[0].value = "0.3"
    with pytest.raises(PassError, match=r"blocks\.0\.ln_1: TaperNorm gate 0\.3; folding needs gate 0"):
        run_passes(m, PASS)


def test_detect_reads_layers_and_gate():
    info = detect_taper(load_graph(scale_to_linears(shift=rng_vec(5, loc=0.0))))
    assert info["layers"] == {"blocks.0.ln_1": ["Mul", "Add"]} and info["gate"] == 0.0 and info["foldable"]


# --- a norm no matrix follows: folded into the matrix before it (graph_passes/output_fold.py) -----------

H, HD = 2, 4     # heads and head width of the per-head case (H * HD = D)


def scale_after_linear(per_head=True, bias=True, shift=None, packed=None, layer="blocks.0.attn.q_norm",
                       extra_reader=False) -> onnx.ModelProto:
    """x ─▶ MatMul(W) [▶ Add(b)] [▶ Slice / Split of a packed Q|K|V] [▶ Reshape [2, 3, H, HD]] ─▶ Mul(s) [▶ Add(t)]
    ─▶ Relu ─▶ y: a QK-norm (per head) or a post-sublayer norm (per_head False) at g = 0 before a non-linear op.
    packed: "slice" or "split": W computes [Q | K] (2 D columns), the scaled tensor is the K part."""
    cols = 2 * D if packed else D
    nodes, inits = [helper.make_node("MatMul", ["x", "W"], ["z0"], name="proj")], [init("W", rng_mat(3, (D, cols)))]
    z = "z0"
    if bias:
        nodes.append(helper.make_node("Add", ["z0", "b"], ["z1"], name="proj_bias"))
        inits.append(init("b", rng_vec(4, cols, 0.0)))
        z = "z1"
    if packed == "slice":
        nodes += [helper.make_node("Slice", [z, "s0", "s1", "ax"], ["q"], name="take_q"),
                  helper.make_node("Slice", [z, "s1", "s2", "ax"], ["k"], name="take_k"),
                  helper.make_node("Relu", ["q"], ["yq"], name="use_q")]
        inits += [init("s0", np.array([0], np.int64)), init("s1", np.array([D], np.int64)),
                  init("s2", np.array([2 * D], np.int64)), init("ax", np.array([-1], np.int64))]
        z = "k"
    elif packed == "split":
        nodes += [helper.make_node("Split", [z, "sizes"], ["q", "k"], name="split_qk", axis=-1),
                  helper.make_node("Relu", ["q"], ["yq"], name="use_q")]
        inits.append(init("sizes", np.array([D, D], np.int64)))
        z = "k"
    if per_head:
        nodes.append(helper.make_node("Reshape", [z, "heads"], ["zh"], name="split_heads"))
        inits.append(init("heads", np.array([2, 3, H, HD], np.int64)))
        z = "zh"
    nodes.append(helper.make_node("Mul", [z, "s"], ["h"], name="norm_mul"))
    inits.append(init("s", rng_vec(5, HD if per_head else D)))
    meta = {"norm_mul": taper_meta(layer)}
    out = "h"
    if shift is not None:
        nodes.append(helper.make_node("Add", ["h", "t"], ["h2"], name="norm_add"))
        inits.append(init("t", shift))
        meta["norm_add"] = taper_meta(layer, op="add")
        out = "h2"
    nodes.append(helper.make_node("Relu", [out], ["y"], name="after"))
    outputs = ["y"] + (["yq"] if packed else [])
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["z0"], ["z_other"], name="other_reader"))
        outputs.append("z_other")
    return model(nodes, inits, outputs=tuple(outputs), meta={"tapernorm.gate": "0.0"}, node_meta=meta)


@pytest.mark.parametrize("kw", [
    {}, {"bias": False}, {"shift": rng_vec(6, HD, loc=0.0)}, {"bias": False, "shift": rng_vec(6, HD, loc=0.0)},
    {"per_head": False, "layer": "blocks.0.post_attn_norm"}, {"packed": "slice"}, {"packed": "split"},
    {"packed": "slice", "bias": False, "shift": rng_vec(6, HD, loc=0.0)},
], ids=["per-head", "no-bias", "affine", "no-bias-affine", "post-norm", "packed-slice", "packed-split",
        "packed-affine"])
def test_a_norm_no_matrix_follows_folds_into_the_matrix_before_it(kw):
    m = scale_after_linear(**kw)
    fused, (res,) = run_passes(m, PASS)
    assert len(res.rewrites) == 1 and res.rewrites[0][1].endswith("-> output of proj"), res.rewrites
    assert "Mul" not in ops(fused) and ops(fused).count("Add") <= 1     # the matrix's bias only
    assert_same(m, fused)


@pytest.mark.parametrize("kw, why", [
    ({"extra_reader": True, "bias": False}, "read by 2 nodes"),           # another node reads the unscaled output
])
def test_no_rewrite_into_a_matrix_whose_output_something_else_reads(kw, why):
    _unchanged(scale_after_linear(**kw), why)


def test_no_rewrite_through_a_transpose_of_the_heads():
    """[2, 3, H, HD] transposed to [2, 3, HD, H], then a scale of H channels: it scales what were the head
    indices, which no column scale of the matrix expresses as the pass reads it."""
    m = scale_after_linear()
    mul = next(n for n in m.graph.node if n.name == "norm_mul")
    mul.input[0] = "zt"
    m.graph.node.insert(list(m.graph.node).index(mul), helper.make_node("Transpose", ["zh"], ["zt"], name="swap",
                                                                        perm=[0, 1, 3, 2]))
    s = next(i for i in m.graph.initializer if i.name == "s")
    s.CopyFrom(init("s", rng_vec(5, H)))
    _unchanged(m, "zt is computed by Transpose, not a linear layer")
