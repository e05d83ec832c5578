"""graph_passes.trt_ops: the TensorRT operator table (versioned) and each restriction rule the lint checks."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graph_passes import run_passes
from graph_passes.trt_ops import (SUPPORTED_10_15, TARGET_TRT, UNSUPPORTED_10_15, max_opset, op_support_issue,
                                  supported_ops)
from tests.graph_passes.fixtures import D, init, model

# The 22 operators the lint used to accept that the 10.15 table marks N (issue 15, item 6)
WRONGLY_LISTED = """AffineGrid BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Compress ConcatFromSequence DFT
DynamicQuantizeLinear MatMulInteger MaxUnpool Multinomial QLinearConv QLinearMatMul SequenceAt SequenceConstruct
SequenceEmpty SequenceErase SequenceInsert SequenceLength SplitToSequence Unique""".split()


def lint(m):
    _, (res,) = run_passes(m, ["trt_lint"])
    return res.notes


def cache_model(cache_shape, axis=None, mode=None, opset=24, dtype=TensorProto.FLOAT):
    """present = TensorScatter(cache, update, pos) over a cache of `cache_shape` (update: one step)."""
    update_shape = list(cache_shape)
    update_shape[-2 if len(cache_shape) > 1 else 0] = 1
    attrs = {k: v for k, v in (("axis", axis), ("mode", mode)) if v is not None}
    node = helper.make_node("TensorScatter", ["cache", "update", "pos"], ["present"], name="write", **attrs)
    g = helper.make_graph([node], "kv",
                          [helper.make_tensor_value_info("cache", dtype, cache_shape),
                           helper.make_tensor_value_info("update", dtype, update_shape),
                           helper.make_tensor_value_info("pos", TensorProto.INT64, [cache_shape[0]])],
                          [helper.make_tensor_value_info("present", dtype, cache_shape)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def test_table_sets_are_disjoint_and_the_wrongly_listed_ops_are_rejected():
    assert not SUPPORTED_10_15 & UNSUPPORTED_10_15
    assert len(WRONGLY_LISTED) == 22
    for op in WRONGLY_LISTED:
        assert op not in supported_ops(TARGET_TRT), op
        assert op_support_issue(op) is not None, op
    assert "MaxRoi" not in SUPPORTED_10_15 and "MaxRoiPool" in UNSUPPORTED_10_15   # the typo is gone
    assert "marked unsupported" in op_support_issue("Unique")
    assert "not in the TensorRT 10.15 operator table" in op_support_issue("MaxRoi")


def test_versions_add_swish_at_11_0_and_dft_at_11_2_and_opset_25_at_11_5():
    assert "Swish" not in supported_ops((10, 15)) and "Swish" in supported_ops((11, 0))
    assert "DFT" not in supported_ops((11, 0)) and "DFT" in supported_ops((11, 2))
    assert "supported from TensorRT 11.2" in op_support_issue("DFT", (11, 0))
    assert op_support_issue("DFT", (11, 2)) is None
    assert (max_opset((10, 15)), max_opset((11, 0)), max_opset((11, 5))) == (24, 24, 25)
    # what our exporter writes parses everywhere the extra allows
    for op in ("TensorScatter", "RMSNormalization", "MatMul", "Softmax", "Gather", "Where", "Trilu"):
        assert op in supported_ops((10, 15)), op


@pytest.mark.parametrize("op", ["Unique", "SplitToSequence", "BitwiseAnd", "Compress"])
def test_an_unsupported_op_in_a_graph_is_flagged(op):
    notes = lint(model([helper.make_node(op, ["x"], ["y"], name="bad")], []))
    assert any(n.startswith("trt: bad (") and "marked unsupported" in n for n in notes), notes


def test_swish_passes_at_the_target_version():
    assert lint(model([helper.make_node("Swish", ["x"], ["y"], name="act")], [])) == []


def test_tensor_scatter_4d_on_axis_minus_2_is_clean():
    assert lint(cache_model([2, 4, 16, 8])) == []                       # axis defaults to -2
    assert lint(cache_model([2, 4, 16, 8], axis=-2, mode="linear")) == []


@pytest.mark.parametrize("shape, axis, mode, expect", [
    ([2, 16, 8], None, None, "rank 3"),                                    # 3-D cache
    ([2, 4, 16, 8], 2, None, "axis is 2"),                                 # same axis, spelled 2: the table says -2
    ([2, 4, 16, 8], 1, None, "axis is 1"),
    ([2, 4, 16, 8], None, "circular", "mode is 'circular'"),
])
def test_tensor_scatter_rank_axis_and_mode_rules(shape, axis, mode, expect):
    notes = lint(cache_model(shape, axis=axis, mode=mode))
    assert any("write (TensorScatter)" in n and expect in n for n in notes), notes


def test_tensor_scatter_cache_type():
    notes = lint(cache_model([2, 4, 16, 8], dtype=TensorProto.INT64))
    assert any("TensorScatter cache of type" in n for n in notes), notes


def test_opset_out_of_range():
    assert any("opset 25" in n and "9..24" in n for n in lint(cache_model([2, 4, 16, 8], opset=25)))


def test_attention_rules():
    nodes = [helper.make_node("Attention", ["x", "x", "x", "", "", "", "lens"], ["y", "", "", "qk"], name="attn",
                              softcap=30.0)]
    notes = lint(model(nodes, [init("lens", np.array([3, 3], np.int64))], outputs=("y", "qk"),
                       inputs=(("x", [2, 2, 3, D]),)))
    for expect in ("nonpad_kv_seqlen", "qk_matmul_output output", "softcap"):
        assert any("attn (Attention)" in n and expect in n for n in notes), (expect, notes)
    assert not any("past/present" in n for n in notes)
    notes = lint(model([helper.make_node("Attention", ["x", "x", "x"], ["y"], name="a3")], []))   # x is 3-D
    assert any("a3 (Attention)" in n and "Q x has rank 3" in n for n in notes), notes


def test_layernorm_extra_outputs_topk_scatternd_dropout_reduce_squeeze():
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g"], ["y", "mean"], name="ln"),
        helper.make_node("TopK", ["x", "k"], ["tv", "ti"], name="topk", sorted=0),
        helper.make_node("ScatterND", ["x", "idx", "upd"], ["s"], name="snd", reduction="add"),
        helper.make_node("Dropout", ["x", "ratio", "train"], ["dr"], name="drop"),
        helper.make_node("Shape", ["x"], ["shp"], name="shape"),
        helper.make_node("Slice", ["shp", "zero", "one"], ["axes"], name="axes_of"),
        helper.make_node("ReduceSum", ["x", "axes"], ["rs"], name="rsum"),
        helper.make_node("Squeeze", ["x"], ["sq"], name="squeeze"),
    ]
    inits = [init("g", np.ones(D, np.float32)), init("k", np.array([2], np.int64)),
             init("idx", np.zeros((1, 1), np.int64)), init("upd", np.zeros((1, 3, D), np.float32)),
             init("ratio", np.array(0.1, np.float32)), init("train", np.array(True)),
             init("zero", np.array([0], np.int64)), init("one", np.array([1], np.int64))]
    notes = lint(model(nodes, inits, outputs=("y", "mean", "tv", "ti", "s", "dr", "rs", "sq")))
    for where, expect in (("ln (", "Mean / InvStdDev"), ("topk (", "sorted=0"), ("snd (", "reduction 'add'"),
                          ("drop (", "training_mode"), ("rsum (", "axes input axes is computed"),
                          ("squeeze (", "Squeeze without axes")):
        assert any(where in n and expect in n for n in notes), (where, notes)


def test_constant_reduce_axes_and_inference_dropout_are_clean():
    nodes = [helper.make_node("ReduceSum", ["x", "ax"], ["y"], name="rsum"),
             helper.make_node("Dropout", ["y", "ratio", "train"], ["z"], name="drop")]
    inits = [init("ax", np.array([-1], np.int64)), init("ratio", np.array(0.1, np.float32)),
             init("train", np.array(False))]
    assert lint(model(nodes, inits, outputs=("z",))) == []


@pytest.mark.parametrize("kind, dtype", [("all-taper", "fp32"), ("baseline", "fp32"), ("all-taper", "fp16")])
def test_our_exported_graphs_lint_clean(kind, dtype):
    """The exporter's fused graphs (TensorScatter 4-D on axis -2, opset 24) pass every rule."""
    from tests.export.exported import exported
    _, proto, fused, _ = exported(kind, dtype)
    assert "TensorScatter" in {n.op_type for n in proto.graph.node}
    assert lint(fused) == [] and lint(proto) == []
