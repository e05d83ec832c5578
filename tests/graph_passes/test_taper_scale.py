"""taper_scale: numerical before/after (ORT optimizations off) and must-not-rewrite cases."""
import numpy as np
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
