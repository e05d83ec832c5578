"""graph_passes/quantized.py: the rewrites of ONNX Runtime's quantizer output, on small graphs built
in code and quantized by ONNX Runtime's own quantizer; each equal to the graph before (ORT,
optimizations off), and each left alone, with a note, where its pattern does not hold."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnxruntime.quantization import matmul_nbits_quantizer as mq

from graph_passes.base import load_graph, save_graph
from graph_passes.lazy import Lazy, lazy_map, transposed
from graph_passes.quantized import (UNTIED, BiasIntoMatMulNBits, EmbeddingLikeHead, ShareTiedTable, Tie, find_tie,
                                    head_matmul)
from tests.graph_passes.fixtures import init, rng_mat, run

V, D, N, BLOCK = 64, 32, 16, 16
IDS = {"input_ids": np.array([[1, 7, 63, 5, 5]], np.int64)}


def _model(nodes, inits, inputs, outputs=("logits",)) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "q", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def tied(e: np.ndarray, w: np.ndarray | None = None) -> onnx.ModelProto:
    """input_ids ──▶ Gather(E) ──▶ MatMul(W) ──▶ logits, W = E^T unless given."""
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["emb"], name="embed"),
             helper.make_node("MatMul", ["emb", "W"], ["logits"], name="head")]
    w = e.T if w is None else w
    return _model(nodes, [init("E", e), init("W", np.ascontiguousarray(w))], [("input_ids", TensorProto.INT64, [1, 5])])


def quantized(proto, ops=("MatMul",), bits=4, symmetric=True) -> onnx.ModelProto:
    """ONNX Runtime's quantizer over a copy (export/quantize.py's call, without the build around it)."""
    cfg = mq.DefaultWeightOnlyQuantConfig(block_size=BLOCK, is_symmetric=symmetric, bits=bits, op_types_to_quantize=ops,
                                          quant_axes=(("MatMul", 0), ("Gather", 1)))
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    q = mq.MatMulNBitsQuantizer(copy, algo_config=cfg)
    q.process()
    return q.model.model


def apply(p, proto):
    ctx = load_graph(proto)
    result = p.run(ctx)
    return save_graph(ctx, proto), result


def ops(proto) -> list[str]:
    return sorted(n.op_type for n in proto.graph.node)


# --- tied_table ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
def test_a_tied_table_reads_the_head_blocks_and_changes_no_value(bits):
    """The embedding a GatherBlockQuantized over the head's own blocks; the logits equal, bit for bit,
    those of the two tables quantized apart (int4: ORT's Gather quantization; int8: no int8 Gather,
    so against the fp32 table rounded the head's way, which is what an int8 table read gives)."""
    e = rng_mat(0, (V, D))
    fp = tied(e)
    tie = find_tie(load_graph(fp))
    assert tie == Tie("emb", "logits") and head_matmul(fp).name == "head"
    twice = quantized(fp, ("MatMul", "Gather") if bits == 4 else ("MatMul",), bits)
    once, result = apply(ShareTiedTable(tie), twice)
    assert [(f.where, f.detail.split(":")[0]) for f in result.folded] == [(result.folded[0].where, "stored once")]
    assert not result.skipped and ops(once).count("GatherBlockQuantized") == 1 and "Gather" not in ops(once)
    gbq = next(n for n in once.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in once.graph.node if n.op_type == "MatMulNBits")
    made_by = {o: n for n in once.graph.node for o in n.output}
    assert [made_by[gbq.input[0]].input[0], made_by[gbq.input[2]].input[0]] == list(head.input[1:3])
    assert len(once.graph.initializer) < len(twice.graph.initializer) or bits == 8   # the Gather's own blocks gone
    if bits == 4:
        np.testing.assert_array_equal(run(once, IDS)["logits"], run(twice, IDS)["logits"])
    else:
        # each of the D products off by at most about one int8 step of the table (a wrong layout: off by ~ the logits)
        np.testing.assert_allclose(run(once, IDS)["logits"], run(twice, IDS)["logits"], atol=D * np.abs(e).max() / 127)


def test_a_table_that_is_not_the_head_transposed_is_untied_and_left_alone():
    e = rng_mat(0, (V, D))
    w = e.T.copy()
    w[3, 5] += 1e-3                                    # one value apart: a fold scaled one of them
    fp = tied(e, w)
    assert find_tie(load_graph(fp)) is None
    q = quantized(fp, ("MatMul", "Gather"))
    out, result = apply(ShareTiedTable(None), q)
    assert not result.folded and [f.why for f in result.skipped] == [UNTIED]
    assert ops(out) == ops(q)


@pytest.mark.parametrize("scaled", [False, True])
def test_the_tie_of_weights_computed_when_written_is_found_by_what_they_are_made_of_unread(scaled):
    """An emitted graph's tables are Lazies (graph_passes/lazy.py): the head's weight is the embedding's
    table transposed (tied), unless a fold scaled it; neither is read to tell."""
    def never():
        raise AssertionError("a Lazy read to find the tie")
    e = rng_mat(0, (V, D))
    table = Lazy((V, D), np.float32, never, ("model.embed.weight",))
    head = transposed(table)
    if scaled:
        head = lazy_map(head, lambda a: a * 2, tag=("scale", "2"))
    tie = find_tie(load_graph(tied(e), {"E": table, "W": head}))
    assert tie == (None if scaled else Tie("emb", "logits"))


@pytest.mark.parametrize("case, why", [
    ("fp32 head", "stored twice: the LM head is a MatMul (not quantized)"),
    ("zero points", "stored twice: the LM head's blocks have zero points"),
    ("width", "stored twice: d_model 24 is not a multiple of the block size 16"),
])
def test_a_tied_head_whose_blocks_cannot_serve_as_the_table_is_left_alone_with_a_note(case, why):
    e = rng_mat(1, (V, 24 if case == "width" else D))
    fp = tied(e)
    tie = find_tie(load_graph(fp))
    assert tie is not None
    q = quantized(fp, ("Gather",)) if case == "fp32 head" else quantized(fp, symmetric=case != "zero points")
    out, result = apply(ShareTiedTable(tie), q)
    assert not result.folded and len(result.skipped) == 1 and result.skipped[0].why.startswith(why)
    assert ops(out) == ops(q)
    np.testing.assert_array_equal(run(out, IDS)["logits"], run(q, IDS)["logits"])


# --- embedding_like_head -------------------------------------------------------------------------

def untied_embedding(d: int = D) -> onnx.ModelProto:
    """input_ids ──▶ Gather(E) ──▶ logits (the embedding alone), plus a position table read by `pos`
    (not a candidate)."""
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["emb"], name="embed"),
             helper.make_node("Gather", ["P", "pos"], ["p"], name="positions"),
             helper.make_node("Add", ["emb", "p"], ["logits"], name="add")]
    return _model(nodes, [init("E", rng_mat(2, (V, d))), init("P", rng_mat(3, (8, d)))],
                  [("input_ids", TensorProto.INT64, [1, 5]), ("pos", TensorProto.INT64, [1, 5])])


def int8_rows(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """E^T quantized as an int8 MatMul weight by ONNX Runtime (export.quantize.head_blocks' call)."""
    q = quantized(_model([helper.make_node("MatMul", ["x", "W"], ["logits"], name="rows")],
                         [init("W", np.ascontiguousarray(table.T))], [("x", TensorProto.FLOAT, [1, table.shape[1]])]),
                  bits=8)
    node = q.graph.node[0]
    values = {i.name: onnx.numpy_helper.to_array(i) for i in q.graph.initializer}
    return values[node.input[1]], values[node.input[2]]


def test_an_untied_embedding_reads_int8_blocks_and_only_it():
    fp = untied_embedding()
    out, result = apply(EmbeddingLikeHead(int8_rows, 8, BLOCK), fp)
    assert [f.detail for f in result.folded] == ["token embedding int8 like the head (GatherBlockQuantized)"]
    assert not result.skipped and ops(out) == ["Add", "Gather", "GatherBlockQuantized", "Reshape", "Reshape"]
    # ONNX Runtime's names for its outputs, as the quantize pass names its own (export/quantize.py BlockQuantizer)
    assert {i.name for i in out.graph.initializer} >= {"E_Q8", "E_scales", "P"}
    feeds = {**IDS, "pos": np.array([[0, 1, 2, 3, 4]], np.int64)}
    data, scales = int8_rows(onnx.numpy_helper.to_array(fp.graph.initializer[0]))
    table = (data.reshape(V, D).astype(np.float32) - 128) * np.repeat(scales.reshape(V, -1), BLOCK, axis=1)
    p = onnx.numpy_helper.to_array(fp.graph.initializer[1])
    np.testing.assert_allclose(run(out, feeds)["logits"], table[IDS["input_ids"]] + p[:5], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(run(out, feeds)["logits"], run(fp, feeds)["logits"], atol=np.abs(table).max() / 127)


def test_an_embedding_narrower_than_a_block_multiple_stays_fp32_with_a_note():
    def never(table):
        raise AssertionError("no blocks for a table left alone")
    fp = untied_embedding(d=24)
    out, result = apply(EmbeddingLikeHead(never, 8, BLOCK), fp)
    assert not result.folded and [f.why for f in result.skipped] == \
        ["token embedding kept fp32: its width is not a multiple of the block size 16"]
    assert ops(out) == ops(fp)


# --- mnb_bias ------------------------------------------------------------------------------------

def bias_sum(bias: np.ndarray | None = None, sum_inputs=("x", "hw", "b"), outputs=("logits",)) -> onnx.ModelProto:
    """Sum(x, MatMul(h, W), b) as ort_bias_sum writes it, quantized: the MatMul a MatMulNBits."""
    b = rng_mat(5, (N,)) if bias is None else bias
    nodes = [helper.make_node("MatMul", ["h", "W"], ["hw"], name="proj"),
             helper.make_node("Sum", list(sum_inputs), ["logits"], name="residual")]
    fp = _model(nodes, [init("W", rng_mat(4, (D, N))), init("b", b)],
                [("x", TensorProto.FLOAT, [1, 3, N]), ("h", TensorProto.FLOAT, [1, 3, D]),
                 ("z", TensorProto.FLOAT, [N])], outputs)
    return quantized(fp)


def _feeds(seed=0):
    r = np.random.default_rng(seed)
    return {"x": r.normal(size=(1, 3, N)).astype(np.float32), "h": r.normal(size=(1, 3, D)).astype(np.float32),
            "z": r.normal(size=N).astype(np.float32)}


def test_the_bias_moves_into_matmulnbits_bit_equal_to_no_sum():
    q = bias_sum()
    out, result = apply(BiasIntoMatMulNBits(), q)
    assert len(result.folded) == 1 and not result.skipped and ops(out) == ["Add", "MatMulNBits"]
    mnb = next(n for n in out.graph.node if n.op_type == "MatMulNBits")
    assert list(mnb.input[3:]) == ["", "", "b"]
    # the graph ort_bias_sum started from, quantized alike: x + (h W + b)
    plain = quantized(_model([helper.make_node("MatMul", ["h", "W"], ["hw"], name="proj"),
                              helper.make_node("Add", ["hw", "b"], ["hwb"], name="bias"),
                              helper.make_node("Add", ["x", "hwb"], ["logits"], name="residual")],
                             [init("W", rng_mat(4, (D, N))), init("b", rng_mat(5, (N,)))],
                             [("x", TensorProto.FLOAT, [1, 3, N]), ("h", TensorProto.FLOAT, [1, 3, D])]))
    feeds = _feeds()
    np.testing.assert_array_equal(run(out, feeds)["logits"], run(plain, {k: feeds[k] for k in ("x", "h")})["logits"])
    np.testing.assert_allclose(run(out, feeds)["logits"], run(q, feeds)["logits"], atol=1e-5)   # Sum: a rounding apart


@pytest.mark.parametrize("case, why", [
    ("bias [1, N]", "third input is not a constant bias [16]"),
    ("bias an input", "third input is not a constant bias [16]"),
    ("output read elsewhere", "output is read elsewhere too"),
    ("fp32 MatMul", "is a MatMul (not quantized)"),
])
def test_a_sum_whose_bias_cannot_move_is_left_alone_with_a_note(case, why):
    if case == "bias [1, N]":
        q = bias_sum(bias=rng_mat(5, (1, N)))
    elif case == "bias an input":
        q = bias_sum(sum_inputs=("x", "hw", "z"))
    elif case == "output read elsewhere":
        q = bias_sum(outputs=("logits", "hw"))
    else:
        q = bias_sum()
        for n in q.graph.node:          # the quantized weight's MatMul back in fp32: a MatMul the quantizer left
            if n.op_type == "MatMulNBits":
                n.CopyFrom(helper.make_node("MatMul", ["h", "W"], list(n.output), name="proj"))
        q.graph.initializer.append(init("W", rng_mat(4, (D, N))))
    out, result = apply(BiasIntoMatMulNBits(), q)
    assert not result.folded and len(result.skipped) == 1 and why in result.skipped[0].why, result.notes
    assert ops(out) == ops(q)
