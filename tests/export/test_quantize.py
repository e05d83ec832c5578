"""export/quantize.py: weight-only int8 / int4 of a fused graph (the graph passes of graph_passes/quantized.py, the
blocks export/rtn.py's), checked against the fp32 graph with the per-dtype tolerance of export.verify; the top-1
agreement a quantized build reports; and the --quantize stage of export.build."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from export.quantize import QuantConfig, QuantizeError, quantize_weights, quantized_config
from export.verify import (SCALE_TOL, VerificationError, ort_session, read_interface, tolerance_key, verify_pair)
from tests.export.exported import exported
from tests.helpers import random_model, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _constant_matmuls(proto) -> int:
    inits = {i.name for i in proto.graph.initializer}
    return sum(n.op_type == "MatMul" and n.input[1] in inits for n in proto.graph.node)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_every_constant_matmul_quantized_and_within_tolerance(dtype):
    _, _, fused, _ = exported("internal-taper")
    q, summary = quantize_weights(fused, QuantConfig(dtype))
    assert summary.matmuls_quantized == _constant_matmuls(fused) == 2 * 6 + 1     # q k v o up down per layer, head
    assert _constant_matmuls(q) == 0 and summary.matmuls_left == 2 * 2             # attention: q@k^T, att@v
    assert summary.gathers_quantized == 1          # the token embedding (the head's table, tied), not wpe
    assert summary.tied_table.startswith("stored once")
    assert summary.weight_bytes_after < summary.weight_bytes_before
    assert quantized_config(q) == QuantConfig(dtype) and quantized_config(fused) is None
    assert read_interface(q) == read_interface(fused)
    assert tolerance_key(fused, q) == dtype and tolerance_key(fused, fused) == "fp32"
    results = verify_pair(fused, q, tokens=list(range(3, 40)))      # raises beyond the dtype's tolerance
    assert max(c.max_abs_diff["logits"] for c in results) > 0       # it did change the graph


@pytest.mark.parametrize("head", ["int8", "fp32"])
def test_the_head_in_other_bits(head):
    """--head: the LM head MatMul alone in int8 (a MatMulNBits with bits 8) or fp32 (a MatMul),
    every other weight int4; within the int4 tolerance, and bytes between all-int4 and fp32."""
    from export.quantize import head_name as head_of
    _, _, fused, _ = exported("internal-taper")
    head_name = head_of(fused)
    q, summary = quantize_weights(fused, QuantConfig("int4", head=head))
    all4, s4 = quantize_weights(fused, QuantConfig("int4"))
    assert summary.head == head and s4.head == "int4"
    nbits = {n.name: next(a.i for a in n.attribute if a.name == "bits") for n in q.graph.node if n.op_type == "MatMulNBits"}
    if head == "int8":
        assert len(nbits) == 13 and list(nbits.values()).count(8) == 1 and list(nbits.values()).count(4) == 12
        assert [n for n in nbits if nbits[n] == 8][0].startswith(head_name)
    else:
        assert len(nbits) == 12 and set(nbits.values()) == {4} and _constant_matmuls(q) == 1
    assert s4.weight_bytes_after < summary.weight_bytes_after < summary.weight_bytes_before
    verify_pair(fused, q, tokens=list(range(3, 40)))                   # int4 tolerance (metadata dtype int4)
    assert quantized_config(q).head_dtype == head


def _logits(proto, ids):
    import onnxruntime as ort
    iface = read_interface(proto)
    feeds = {"input_ids": ids, "position": np.zeros(ids.shape[0], np.int64),
             **{c: np.zeros(iface.cache_shape(ids.shape[0]), np.float32) for c in iface.cache_names()}}
    return ort_session(proto).run(["logits"], feeds)[0]


def test_the_tied_table_is_stored_once_and_changes_no_value(monkeypatch):
    """A tied head (norm_gamma leaves it untouched): the token embedding becomes a GatherBlockQuantized
    over the head's own int4 blocks, and the logits equal, bit for bit, those of the same quantization
    with the table stored twice (ORT quantizes the Gather and the MatMul to the same values)."""
    _, _, fused, _ = exported("internal-taper")
    once, s_once = quantize_weights(fused, QuantConfig("int4"))
    monkeypatch.setattr("graph_passes.quantized.find_tie", lambda proto: None)
    twice, s_twice = quantize_weights(fused, QuantConfig("int4"))
    monkeypatch.undo()
    assert s_once.tied_table.startswith("stored once") and s_twice.tied_table.startswith("untied")
    v, d = 320, 32                                                     # tests.helpers.random_model's vocab, width
    saved = v * d // 2 + v * d // 32 * 4 - 16          # int4 values + fp32 scales, less the Reshape's shape [2]
    assert s_twice.weight_bytes_after - s_once.weight_bytes_after == saved
    gbq = next(n for n in once.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in once.graph.node if n.op_type == "MatMulNBits" and "logits" in n.output)
    producers = {o: n for n in once.graph.node for o in n.output}
    assert [producers[gbq.input[0]].input[0], producers[gbq.input[2]].input[0]] == list(head.input[1:3])
    ids = np.array([[1, 7, 300, 5, 5, 19]], np.int64)
    assert np.array_equal(_logits(once, ids), _logits(twice, ids))


@pytest.mark.parametrize("cfg, stored", [
    (QuantConfig("int8"), "stored once: the token embedding reads the LM head's int8 blocks"),
    (QuantConfig("int4", head="int8"), "stored once: the token embedding reads the LM head's int8 blocks"),
    (QuantConfig("int4", head="fp32"), "stored twice: the LM head is a MatMul"),
    (QuantConfig("int4", algo="hqq"), "stored twice: the LM head's blocks have zero points"),
])
def test_the_tied_table_with_other_head_bits(cfg, stored):
    """int8 (ORT's quantizer leaves an int8 Gather fp32) and --head int8: the embedding reads the
    int8 head's blocks, so it is int8 too; an fp32 or asymmetric (hqq) head keeps two tables."""
    _, _, fused, _ = exported("internal-taper")
    q, summary = quantize_weights(fused, cfg)
    assert summary.tied_table.startswith(stored)
    verify_pair(fused, q, tokens=list(range(3, 40)))                   # within the dtype's tolerance


@pytest.mark.parametrize("cfg, bits", [(QuantConfig("int4"), None), (QuantConfig("int8"), 8),
                                       (QuantConfig("int4", head="int8"), 8)])
def test_an_untied_embedding_is_stored_like_the_head(cfg, bits):
    """Untied: the embedding keeps its own table, in int4 (ORT's Gather quantization, `bits`
    attribute absent) or, under an int8 head, int8 blocks from ORT's MatMul quantizer."""
    _, _, fused, _ = exported("all-taper-affine-ln-swiglu-untied")
    q, summary = quantize_weights(fused, cfg)
    assert summary.tied_table.startswith("untied")
    gbq = [n for n in q.graph.node if n.op_type == "GatherBlockQuantized"]
    assert len(gbq) == 1 and not any(n.op_type == "Gather" and "input_ids" in n.input for n in q.graph.node)
    assert {a.name: a.i for a in gbq[0].attribute}.get("bits") == bits
    verify_pair(fused, q, tokens=list(range(3, 40)))


def _bits(proto) -> list[int]:
    return [next(a.i for a in n.attribute if a.name == "bits") for n in proto.graph.node if n.op_type == "MatMulNBits"]


def test_int8_layers_keep_named_layers_in_int8():
    """--int8-layers v_proj,down_proj (llama.cpp Q4_K_M's choice): those MatMuls in 8 bits,
    the rest in 4, within the int4 tolerance; the config survives in the metadata."""
    _, _, fused, _ = exported("internal-taper")
    cfg = QuantConfig("int4", int8_layers=("v_proj", "down_proj"))
    q, summary = quantize_weights(fused, cfg)
    assert sorted(_bits(q)) == [4] * 9 + [8] * 4                     # 2 layers x (v, down) in 8 bits
    assert summary.notes == ["4 MatMul(s) of --int8-layers v_proj,down_proj in int8"]
    assert quantized_config(q) == cfg
    verify_pair(fused, q, tokens=list(range(3, 40)))
    q, _ = quantize_weights(fused, QuantConfig("int4", head="fp32", int8_layers=("blocks.1.attn.v_proj",)))
    assert sorted(_bits(q)) == [4] * 11 + [8] and _constant_matmuls(q) == 1        # the head stays fp32


@pytest.mark.parametrize("cfg, match", [
    (QuantConfig("int4", int8_layers=("v_prj",)), r"--int8-layers v_prj: .*found none \(layers here end in: .*v_proj"),
    (QuantConfig("int8", int8_layers=("v_proj",)), "expected --quantize int4 with rtn"),
])
def test_int8_layers_that_select_nothing_are_one_line_errors(cfg, match):
    _, _, fused, _ = exported("internal-taper")
    with pytest.raises(QuantizeError, match=match):
        quantize_weights(fused, cfg)


def test_int8_is_closer_than_int4():
    _, _, fused, _ = exported("baseline")
    worst = {d: max(c.max_abs_diff["logits"] for c in verify_pair(fused, quantize_weights(fused, QuantConfig(d))[0]))
             for d in ("int8", "int4")}
    assert 0 < worst["int8"] < worst["int4"]


def test_a_broken_quantization_fails_verification():
    """Scales multiplied by 3 (a wrong dequantization) must not pass the int4 tolerance."""
    _, _, fused, _ = exported("baseline")
    q, _ = quantize_weights(fused, QuantConfig("int4"))
    for t in q.graph.initializer:
        if t.name.endswith("_scales"):
            arr = onnx.numpy_helper.to_array(t) * 3
            t.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float32), t.name))
    with pytest.raises(VerificationError, match=f"scale_tol|{SCALE_TOL['int4']:g}|max abs diff"):
        verify_pair(fused, q)


def test_top1_agreement_is_one_against_itself_and_measures_drift():
    """export.reference_check.teacher_forced_top1 over the agreement session a quantized build runs (agreement_steps: one prefill of
    real text, AGREEMENT_TOKENS positions or the capacity): 1 against itself, between 0 and 1 for int4, and
    about 0 for logits negated (argmax becomes argmin)."""
    from export.conventions import run_onnx
    from export.reference_check import agreement_steps, teacher_forced_top1
    from export.quantize import AGREEMENT_TOKENS
    _, _, fused, _ = exported("baseline")
    iface = read_interface(fused)
    assert agreement_steps(None, iface) == []                           # no text: no agreement session
    sessions = agreement_steps([5, 9, 11, 200, 3], iface)              # the text repeated to fill it
    n = min(AGREEMENT_TOKENS, iface.capacity)
    assert len(sessions) == 1 and len(sessions[0]) == 1 and sessions[0][0].input_ids.shape == (1, n)

    def runs(proto):
        return [run_onnx(ort_session(proto), iface, steps) for steps in sessions]
    ref = runs(fused)
    assert teacher_forced_top1(ref, ref) == (1.0, n)
    q, _ = quantize_weights(fused, QuantConfig("int4"))
    agree, positions = teacher_forced_top1(ref, runs(q))
    assert positions == n and 0.0 < agree <= 1.0
    negated = onnx.ModelProto()
    negated.CopyFrom(fused)
    last = next(node for node in negated.graph.node if "logits" in node.output)
    last.output[list(last.output).index("logits")] = "logits_before_neg"
    negated.graph.node.append(onnx.helper.make_node("Neg", ["logits_before_neg"], ["logits"]))
    agree, _ = teacher_forced_top1(ref, runs(negated))
    assert agree < 0.05


@pytest.mark.parametrize("bits,k", [(4, 96), (4, 100), (8, 64)])
def test_block_quantization_split_over_cores_equals_onnx_runtimes_quantizer(monkeypatch, bits, k):
    """BlockQuantizer quantizes a MatMul weight by export/rtn.py directly (no one-node graph, so no copies of a
    GB head), its columns split over the cores (_by_columns): the parts' blocks side by side are byte for byte
    what ONNX Runtime's quantizer writes for the whole weight in a graph."""
    from export.quantize import BlockQuantizer, _by_columns, quantize_one_node
    w = np.random.default_rng(0).standard_normal((k, 50)).astype(np.float32)
    cfg = QuantConfig("int4" if bits == 4 else "int8", 32)
    theirs = quantize_one_node("MatMul", w, cfg)
    assert sorted(theirs) == [1, 2]                                     # symmetric: no zero points
    from export import rtn
    monkeypatch.setattr("os.cpu_count", lambda: 3)
    widths, matmul_blocks = [], rtn.matmul_blocks
    monkeypatch.setattr(rtn, "matmul_blocks", lambda part, *a: widths.append(part.shape[1]) or matmul_blocks(part, *a))
    split = _by_columns(w, bits, 32, min_columns=16)
    assert widths == [16, 17, 17]                                       # 3 parts: columns 0-16, 16-33, 33-50
    whole = BlockQuantizer(cfg).blocks("MatMul", w, bits)
    for role, mine in ((1, split[0]), (2, split[1])):
        np.testing.assert_array_equal(mine, onnx.numpy_helper.to_array(theirs[role]))
        np.testing.assert_array_equal(whole[role - 1], mine)


@pytest.mark.parametrize("cfg, match", [
    (QuantConfig("int3"), "--quantize 'int3'"),
    (QuantConfig("int4", block_size=48), "--block-size 48: expected one of 16, 32, 64, 128, 256"),
    (QuantConfig("int8", block_size=1024), "--block-size 1024"),       # ORT's quantizer would fail after the export
    (QuantConfig("int4", accuracy_level=7), "0..4"),
    (QuantConfig("int4", algo="gptq"), "one of rtn, hqq"),
    (QuantConfig("int8", algo="hqq"), "4-bit only"),
    (QuantConfig("int4", head="int2"), "--head 'int2'"),
])
def test_bad_configs_are_one_line_user_errors(cfg, match):
    with pytest.raises(QuantizeError, match=match) as e:
        cfg.validate()
    assert e.value.exit_code == 2           # options alone decide it: a wrong command line


def test_build_quantize_and_gqa_attention_end_to_end(tmp_path):
    """One graph, model.int4.onnx (no model.fused.onnx beside it), verified against torch with its own dequantized
    weights; its drift and top-1 agreement over 128 positions of real text against the float model reported; within
    the int4 tolerance of the float graph (export.verify's command, on the fused graph built in memory)."""
    ckpt = write_checkpoint(tmp_path / "ckpt", random_model(seed=3, norm="taper", taper_scope="internal", gate=0.0,
                                                            max_seq_len=160))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "export.build", "--fuse", "--quantize", "int4", "--head", "int8",
                        "--int8-layers", "qkv_proj", "--attention", "gqa", "--checkpoint", str(ckpt), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[5/5] verify model.int4.onnx" in r.stdout and "top-1 agreement" in r.stdout
    assert (out / "model.int4.onnx").is_file() and not (out / "model.fused.onnx").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["graph"] == "model.int4.onnx"
    q = report["quantized"]
    assert q["file"] == "model.int4.onnx" and q["config"]["dtype"] == "int4" and q["matmuls_quantized"] == 9
    assert q["config"]["head"] == "int8" and q["head"] == "int8"            # 2 x (qkv, out, up, down) in 4 bits, the head in 8
    assert q["weight_bytes_after"] == report["weight_bytes"] < q["weight_bytes_before"]
    assert q["drift"]["top1_positions"] == 128 and q["drift"]["top1_agreement"] >= q["tolerance"]["min_top1"]
    assert q["drift"]["top1_prompt"].startswith("real text")
    assert q["drift"]["logits_mean_abs_diff"] <= q["drift"]["logits_max_abs_diff"]
    assert q["tolerance"]["checked_against"] == "dequantized weights" and report["atol"] == q["tolerance"]["atol"]
    assert set(report["max_abs_diff"]) == {"graph_vs_torch"} and set(report["op_counts"]) == {"emitted", "int4"}
    assert report["attention"] == "gqa"                                    # verified against torch by the build
    assert report["op_counts"]["emitted"]["Attention"] == 2                # emitted as the portable fused-attention graph
    ops = report["op_counts"]["int4"]
    assert ops["GroupQueryAttention"] == 2 and not {"Attention", "Softmax", "TensorScatter"} & set(ops)
    assert sorted(_bits(onnx.load(str(out / "model.int4.onnx")))) == [4] * 6 + [8] * 3   # the packed Q/K/V, the head
    assert any("com.microsoft" in line for line in report["trt_lint"])     # the lint says: ONNX Runtime only
    from runtime.ort_session import OrtSession                             # and our runtime runs it
    with OrtSession(out / "model.int4.onnx") as s:
        s.reset(1)
        assert s.prefill(np.array([[1, 2, 3]])).shape == (1, 3, 320)
    from export.pipeline import build_graph
    from models.weights import open_weights
    fused = tmp_path / "float" / "model.fused.onnx"
    fused.parent.mkdir()
    build_graph(open_weights(ckpt), fused, fuse=True, attention="gqa", verify=False)
    r = subprocess.run([sys.executable, "-m", "export.verify", str(fused), str(out / "model.int4.onnx")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "EQUAL" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("bad", [np.nan, np.inf, -3e38, 2.0 ** 65])
def test_a_weight_past_the_range_is_refused_in_one_line_whatever_its_layout(bad):
    """rtn's range check reads the blocks' scales (max |scale| x 2^(bits-1) is max |w|): a NaN, an inf or a weight
    past QUANT_MAX_ABS is the same WeightRangeError as the check over w says it; one within the range passes."""
    from export.quantize import QUANT_MAX_ABS, BlockQuantizer, WeightRangeError
    q = BlockQuantizer(QuantConfig("int4"))
    w = np.ones((64, 48), np.float32)
    w[3, 5] = bad
    found = "NaN or inf" if not np.isfinite(bad) else f"|w| up to {abs(bad):.3g}"
    for laid in (w, np.asfortranarray(w)):
        with pytest.raises(WeightRangeError, match=rf"^x: expected finite weights of magnitude <= 1.84e\+19 to "
                                                   rf"quantize to int4, found {re.escape(found)} "):
            q.blocks("MatMul", laid, 4, "x")
    w[3, 5] = QUANT_MAX_ABS
    assert len(q.blocks("MatMul", w, 4, "x")) == 2
