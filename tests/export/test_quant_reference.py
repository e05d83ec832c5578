"""export/quant_reference.py: the torch reference of a quantized graph (GraphWeights: the folded model with the
graph's own blocks dequantized), read from the written graph, and dequantized_rows against export/rtn.py.

A quantized build is verified against this reference (export/reference_check.py verify_graph), so it must be what the
written graph computes: with MatMulNBits at accuracy level 0 (fp32 arithmetic) the two agree to fp32 rounding,
on a zoo model (DyT's shifts folded through the float weights, its own int4 table) and on a tiny Hugging Face
family (Q/K/V packed into one MatMulNBits under --attention gqa, the embedding in the int8 head's blocks); the
slow run adds Qwen2 in int8, GPT-2 (LayerNorm, the tied table stored once) and --int8-layers. It must also read
the graph, not quantize the float model again: a graph whose scales are doubled fails against the reference of
the graph it came from, and passes against its own.
"""
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from export.quant_reference import GraphWeights, dequantized_rows
from export.quantize import QuantConfig
from export.rtn import dequantize_matmul, matmul_blocks

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k, block", [(96, 32), (100, 32), (99, 16), (64, 64)])
def test_dequantized_rows_are_rtns_dequantized_weight(bits, k, block):
    """torch's (q - 2^(bits-1)) * scale in nn.Linear's layout [N, K] is dequantize_matmul's [K, N] transposed, bit
    for bit (whole and partial last blocks, an odd K's stale nibble past row K-1 ignored)."""
    w = np.random.default_rng(k + bits).standard_normal((k, 48)).astype(np.float32)
    B, scales = matmul_blocks(w, bits, block)
    rows = dequantized_rows(B, scales, k, bits, block)
    assert rows.dtype == torch.float32 and tuple(rows.shape) == (48, k) and rows.is_contiguous()
    expected = np.ascontiguousarray(dequantize_matmul(B, scales, k, bits, block).T)
    np.testing.assert_array_equal(rows.numpy(), expected)
    step = np.abs(w).max(axis=0) / (1 << (bits - 1))                     # one code's step per column, at most
    assert 0 < np.abs(rows.numpy() - w.T).max() <= step.max()             # quantized, within a step of w


def _folder(source: str, tmp_path: Path) -> Path:
    kind, name = source.split(":")
    if kind == "zoo":
        return ZOO / name
    from tests.hf_models import hf_model, save_hf
    # ONNX Runtime's GroupQueryAttention rotates heads of a multiple of 16: the tiny Llama's and Qwen2's 8 doubled
    return save_hf(hf_model(name, **(dict(hidden_size=64) if name in ("llama", "qwen2") else {})), tmp_path / name)


def _runs(source, path: Path, parts=None):
    """(torch reference runs, with `parts`; ONNX Runtime's runs of `path`) on the build's verification sessions."""
    from core.contract import contract_of
    from export.conventions import run_onnx, verification_sessions
    from export.verify import ort_session
    from models.layerwise import layerwise_run, used_slots
    iface = contract_of(path)
    sessions = verification_sessions(iface, None)          # (a graph of plain attention: any start)
    steps = [s for _, s in sessions]
    refs = layerwise_run(source, steps, parts=parts)
    sess = ort_session(path)
    return sessions, refs, [run_onnx(sess, iface, s, trim=used_slots(s)) for s in steps]


CASES = [
    # (source, attention, quantize): at accuracy level 0 the graph computes in fp32, so what is left is rounding
    ("zoo:dyt", "plain", QuantConfig("int4", accuracy_level=0)),                # shifts; its own int4 table
    ("hf:llama", "gqa", QuantConfig("int4", head="int8", accuracy_level=0)),    # packed Q/K/V, int8 head blocks
    pytest.param("hf:qwen2", "gqa", QuantConfig("int8", accuracy_level=0), marks=pytest.mark.slow),   # q/k/v biases
    pytest.param("hf:gpt2", "plain", QuantConfig("int4", accuracy_level=0), marks=pytest.mark.slow),  # the tied table
    pytest.param("zoo:all-taper", "plain", QuantConfig("int4", int8_layers=("v_proj",), accuracy_level=0),
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("source, attention, cfg", CASES)
def test_a_quantized_build_equals_its_dequantized_reference(tmp_path, source, attention, cfg):
    from export.options import BuildOptions
    from export.pipeline import build
    from export.verify import ATOL, DEQUANTIZED, SCALE_TOL
    out = tmp_path / "out"
    report = build(_folder(source, tmp_path), out, BuildOptions(True, quantize=cfg, attention=attention),
                   log=lambda *a: None)
    assert report.quantized.tolerance.checked_against == "dequantized weights"
    assert (report.verification.atol, report.verification.scale_tol) == (ATOL[DEQUANTIZED], SCALE_TOL[DEQUANTIZED])
    per = report.verification.graph_vs_torch
    worst = max(v for d in per.values() for v in d.values())
    # fp32 MatMulNBits against fp32 torch on the same weights: fp32 rounding, far inside the build's bound
    assert 0 < worst < 1e-4, per
    assert report.quantized.drift.logits_max_abs_diff > 100 * worst      # the float model is another one


def test_a_graph_whose_scales_are_doubled_fails_against_the_reference(tmp_path):
    """The reference is read from the graph's own blocks: a graph with doubled scales fails against the reference
    of the graph it was made from, by far, and passes against its own (the reference follows the graph). The zoo's
    TaperNorm model: its tied table stored once, the embedding reading the head's blocks through a Reshape."""
    from core.onnx_writer import save_onnx
    from export.options import BuildOptions
    from export.pipeline import build
    from export.verify import DEQUANTIZED, VerificationError, compare_sessions
    from models.weights import open_weights
    out = tmp_path / "out"
    build(ZOO / "internal-taper", out, BuildOptions(True, quantize=QuantConfig("int4")), log=lambda *a: None)
    good = out / "model.int4.onnx"
    proto = onnx.load(str(good))
    doubled = 0
    for t in proto.graph.initializer:
        if t.name.endswith("_scales"):
            t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) * np.float32(2), t.name))
            doubled += 1
    assert doubled == 4 * 6 + 1               # 6 MatMulNBits a block and the head's (the table reads the head's)
    bad = tmp_path / "doubled" / "model.int4.onnx"
    bad.parent.mkdir()
    save_onnx(proto, bad)
    source = open_weights(ZOO / "internal-taper")
    sessions, refs, runs = _runs(source, bad, GraphWeights(source, good))
    with pytest.raises(VerificationError, match="logits: max abs diff"):
        compare_sessions(sessions, refs, runs, DEQUANTIZED, "doubled scales vs the graph's reference")
    own = GraphWeights(source, bad)                         # (the copy's weights are inline, not external)
    assert torch.equal(own.embedding(), 2 * GraphWeights(source, good).embedding())
    sessions, refs, runs = _runs(source, bad, own)
    compare_sessions(sessions, refs, runs, DEQUANTIZED, "doubled scales vs its own reference")


@pytest.mark.parametrize("external", [False, True])
def test_a_4_bit_initializer_is_read_as_its_packed_bytes(tmp_path, external):
    """GatherBlockQuantized's int4 table, inline (a graph saved whole) or in external data (a build's): its bytes
    as ONNX packs them, which export.rtn.dequantize_gather reads (an inline one was read as one value a byte)."""
    from onnx import helper
    from core.onnx_writer import StreamedWeights
    from export.quant_reference import initializer_array
    from export.rtn import dequantize_gather, gather_blocks
    table = np.random.default_rng(0).standard_normal((51, 41)).astype(np.float32)      # an odd count: a pad nibble
    q = gather_blocks(table, 4, 16)
    t = helper.make_tensor("table_Q4", q.data_type, q.shape, q.data.tobytes(), raw=True)
    if external:
        with StreamedWeights(tmp_path / "g.onnx") as out:
            out.put_raw(t, q.data.tobytes())            # (over core.onnx_writer.INLINE_BELOW: to g.onnx.data)
        assert t.data_location == onnx.TensorProto.EXTERNAL
    data = initializer_array(tmp_path, t)
    np.testing.assert_array_equal(data, q.data)
    np.testing.assert_array_equal(dequantize_gather(data, q.scales, q.shape, 16),
                                  dequantize_gather(q.data, q.scales, q.shape, 16))


@pytest.mark.parametrize("source", ["zoo:dyt", "zoo:internal-taper"])
def test_the_embedding_rows_asked_for_are_the_whole_tables_rows(tmp_path, source):
    """GraphWeights.embedded dequantizes only the rows of the tokens asked for: the same values, bit for bit, as
    the whole dequantized table's rows; DyT's own int4 table (GatherBlockQuantized) and the TaperNorm model's
    tied table (the head's MatMulNBits blocks)."""
    from export.options import BuildOptions
    from export.pipeline import build
    from models.weights import open_weights
    folder = _folder(source, tmp_path)
    build(folder, tmp_path / "out", BuildOptions(True, quantize=QuantConfig("int4")), log=lambda *a: None)
    parts = GraphWeights(open_weights(folder), tmp_path / "out" / "model.int4.onnx")
    assert parts.table is not None
    ids = [torch.tensor([[5, 3, 5, 0]]), torch.tensor([[parts.cfg.vocab_size - 1], [3]])]
    table = parts.embedding()
    for got, i in zip(parts.embedded(ids), ids):
        assert got.shape == i.shape + (parts.cfg.d_model,)
        assert torch.equal(got, table[i])
