"""channel_scale: any norm's per-channel gain, seen through reshapes and Shape readers; must-not-rewrite cases."""
import numpy as np
import pytest
from onnx import helper

from graph_passes import run_passes
from tests.graph_passes.fixtures import (D, OUT, assert_same, exploded_rmsnorm, init, model, ops, rng_mat, rng_vec,
                                         scale_to_linears, x_feed)

PASS = ["channel_scale"]


def _folded(m, feeds=None):
    fused, (res,) = run_passes(m, PASS)
    assert len(res.rewrites) == 1 and res.notes == [], res
    assert_same(m, fused, feeds)
    return fused, res


@pytest.mark.parametrize("cls", ["transformers.models.llama.modeling_llama.LlamaRMSNorm",
                                 "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm", "my_lib.ScaleNorm", None],
                         ids=["llama", "qwen2", "users-own", "no-provenance"])
def test_exploded_rmsnorm_gamma_folds_and_shape_reads_the_unscaled_tensor(cls):
    m = exploded_rmsnorm(cls)
    fused, res = _folded(m)
    assert ops(fused).count("Mul") == 1                      # only x * 1/rms is left
    where, detail = res.rewrites[0]
    assert detail.startswith(cls.rsplit(".", 1)[-1] + " gamma" if cls else "RMSNorm (exploded) gamma")
    assert detail.endswith("-> proj0, proj1, proj2")
    shape = next(n for n in fused.graph.node if n.op_type == "Shape")
    assert shape.input[0] == "xn"                            # reads the unscaled tensor, same shape


@pytest.mark.parametrize("shift", [None, rng_vec(5, loc=0.0)], ids=["scale", "scale+shift"])
def test_a_mul_without_provenance_folds(shift):
    _folded(scale_to_linears(meta=False, shift=shift))


def test_view_before_the_linear_is_seen_through():
    """ln_f ─▶ view [-1, D] ─▶ head: the Reshape regroups whole channel rows."""
    fused, res = _folded(exploded_rmsnorm(reshape=[-1, D]))
    assert "via 1 reshape(s)" in res.rewrites[0][1] and "Reshape" in ops(fused)


def test_conv1d_reshape_gemm_reshape_is_seen_through():
    """GPT-2's Conv1D: Reshape [-1, D] ─▶ Gemm(W, b) ─▶ Reshape back."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["h"], name="ln_mul"),
             helper.make_node("Add", ["h", "t"], ["h2"], name="ln_add"),
             helper.make_node("Reshape", ["h2", "flat"], ["h2d"], name="view_in"),
             helper.make_node("Gemm", ["h2d", "W", "b"], ["g"], name="c_attn"),
             helper.make_node("Reshape", ["g", "back"], ["y"], name="view_out")]
    m = model(nodes, [init("s", rng_vec(1)), init("t", rng_vec(2, loc=0.0)), init("flat", np.array([-1, D], np.int64)),
                      init("W", rng_mat(3)), init("b", rng_vec(4, OUT, 0.0)), init("back", np.array([2, 3, OUT], np.int64))])
    fused, _ = _folded(m)
    assert sorted(ops(fused)) == ["Gemm", "Reshape", "Reshape"]


def test_a_non_norm_mul_in_a_torch_graph_is_not_a_candidate():
    m = exploded_rmsnorm("transformers.models.gpt2.modeling_gpt2.GPT2MLP")
    fused, (res,) = run_passes(m, PASS)
    assert res.rewrites == [] and res.notes == [] and sorted(ops(fused)) == sorted(ops(m))


# --- must not rewrite: untouched, with a note -----------------------------------------------------

def _unchanged(m, note_part, feeds=None):
    fused, (res,) = run_passes(m, PASS)
    assert res.rewrites == []
    assert sorted(ops(fused)) == sorted(ops(m))
    assert len(res.notes) == 1 and note_part in res.notes[0], res.notes
    assert_same(m, fused, feeds)
    return res.notes[0]


def test_scale_shared_with_a_non_linear_consumer():
    note = _unchanged(exploded_rmsnorm(extra=("Relu",)), "is a Relu, not a MatMul/Gemm")
    assert note.startswith("layers.0.input_layernorm: left unfolded: extra0")


def test_broadcasting_scale():
    # x [2, 3, 1] * s [D] has shape [2, 3, D]: folding would drop the broadcast
    m = scale_to_linears(meta=False)
    m.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 1
    _unchanged(m, "broadcasts x, whose last axis has 1", x_feed(shape=(2, 3, 1)))


def test_scale_on_the_wrong_axis():
    # s of shape [3, 1] scales the token axis of x [2, 3, D], not the channels
    _unchanged(scale_to_linears(scale=rng_vec(1, n=3), scale_shape=(3, 1), meta=False), "not per-channel on the last axis")


def test_reshape_that_moves_the_channel_axis():
    # [2, 3, 8] -> [2, 3, 2, 4]: the MatMul mixes halves of the channel axis, not channels
    _unchanged(exploded_rmsnorm(reshape=[2, 3, 2, 4]), "moves the channel axis")


def test_a_view_with_a_computed_shape_is_seen_through():
    """Optimum's ln_f view: Reshape(h, Concat(batch, seq, Gather(Shape(h), -1))) keeps the last axis."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["h"], name="ln_mul"),
             helper.make_node("Shape", ["h"], ["shp"], name="shape"),
             helper.make_node("Gather", ["shp", "last"], ["d"], name="take_d", axis=0),
             helper.make_node("Unsqueeze", ["d", "zero"], ["d1"], name="d1"),
             helper.make_node("Slice", ["shp", "zero", "two"], ["bt"], name="bt"),
             helper.make_node("Concat", ["bt", "d1"], ["target"], name="target", axis=0),
             helper.make_node("Reshape", ["h", "target"], ["v"], name="view"),
             helper.make_node("MatMul", ["v", "W"], ["y"], name="lm_head")]
    m = model(nodes, [init("s", rng_vec(1)), init("last", np.array(-1, np.int64)), init("zero", np.array([0], np.int64)),
                      init("two", np.array([2], np.int64)), init("W", rng_mat(2))],
              inputs=(("x", ["batch", "seq", D]),))
    fused, res = _folded(m)
    assert "via 1 reshape(s)" in res.rewrites[0][1] and "Mul" not in ops(fused)
