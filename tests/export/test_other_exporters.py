"""graph_passes + export.verify on graphs other tools wrote: tiny random-init GPT-2, Llama and Qwen2
(transformers, built here) exported by torch.onnx (dynamo, opset 18 and 24), then optionally
rewritten by ONNX Runtime's transformers optimizer first.

Every norm gain / shift must fold (counted), the folded graph must match the
unfolded one within FOLD_ATOL_FP32 with ORT optimizations off, and export.verify
must call the pair EQUAL. The default run covers each exporter pattern once
(GPT-2 opset 18: LayerNormalization, Conv1D as Reshape -> Gemm -> Reshape, the view
before the head; Llama opset 24: the exploded RMSNorm with LlamaRMSNorm
provenance); the other model / opset pairs are marked slow and run only when
selected (`pytest -m slow tests/export/test_other_exporters.py`).
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

pytest.importorskip("transformers")

from export.conventions import detect                                          # noqa: E402
from export.verify import ort_session, verify_pair                             # noqa: E402
from graph_passes import run_passes                                             # noqa: E402
from tests.export.hf_style import LN_FREE_INV_STD, N_LAYER, NORMS_PER_MODEL, hf_export   # noqa: E402

# fp32: a fold reorders one per-channel product per linear layer ((x*s)@W vs x@(sW)):
# a few ulp on logits of magnitude ~1 in these tiny models; 1e-5 catches any
# wrong or missing scale (a gain of 1 +- 0.2 moves logits by > 1e-2).
FOLD_ATOL_FP32 = 1e-5
# which pass folds the norms of each model as torch.onnx writes it
FOLDING_PASS = {"gpt2": "norm_gamma", "llama": "channel_scale", "qwen2": "channel_scale"}
# norm_gamma leaves the final norm's gamma in the op when the head is tied to the embedding
# (GPT-2): the norm op applies it for free and the head stays the embedding's table. The
# exploded norms (channel_scale) lose a Mul by folding, and these Llama / Qwen2 are untied.
TIED = {"gpt2": 1, "llama": 0, "qwen2": 0, "gpt2-ln-free": 0}

CASES = [pytest.param("gpt2", 18), pytest.param("llama", 24),
         pytest.param("gpt2", 24, marks=pytest.mark.slow), pytest.param("llama", 18, marks=pytest.mark.slow),
         pytest.param("qwen2", 18, marks=pytest.mark.slow), pytest.param("qwen2", 24, marks=pytest.mark.slow)]


@pytest.fixture(autouse=True)
def _heavy_variants_only_when_asked(request):
    """The slow variants export more models (minutes on 2 cores): they run when -m selects slow."""
    if request.node.get_closest_marker("slow") and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("heavy exporter variant: run with -m slow")


def _folds(results):
    return {r.name: len(r.folded) for r in results if r.folded and r.name != "fold_constants"}


def _equal(before, after):
    """export.verify (prefill + growing prefix, every output) within FOLD_ATOL_FP32."""
    comparisons = verify_pair(before, after, atol=FOLD_ATOL_FP32)
    assert comparisons and all(c.worst <= FOLD_ATOL_FP32 for c in comparisons)
    return max(c.worst for c in comparisons)


@pytest.mark.parametrize("kind,opset", CASES)
def test_every_norm_folds_and_verifies_equal(kind, opset):
    proto = hf_export(kind, opset)
    fused, results = run_passes(proto)
    assert _folds(results) == {FOLDING_PASS[kind]: NORMS_PER_MODEL - TIED[kind]}
    assert [str(f) for r in results for f in r.skipped if "tied" not in str(f)] == []
    if kind == "gpt2":       # LayerNormalization stays, with gamma = 1 and no beta (ln_f, before the tied head: both)
        norms = [n for n in fused.graph.node if n.op_type == "LayerNormalization"]
        assert len(norms) == NORMS_PER_MODEL and [len(n.input) for n in norms] == [2] * (NORMS_PER_MODEL - 1) + [3]
    else:                    # no Mul by a constant vector is left: the gains are in the weights
        inits = {i.name: numpy_helper.to_array(i) for i in fused.graph.initializer}
        vec_muls = [n for n in fused.graph.node if n.op_type == "Mul"
                    and any(i in inits and inits[i].size == 16 for i in n.input)]
        assert vec_muls == []
    _equal(proto, fused)
    assert run_passes(proto)[0].SerializeToString() == fused.SerializeToString()     # deterministic
    again, rerun = run_passes(fused)                                                  # idempotent
    assert _folds(rerun) == {} and again.SerializeToString() == fused.SerializeToString()


def _disable_norms(proto: onnx.ModelProto, eps: float = 1e12) -> onnx.ModelProto:
    """The same graph with every LayerNormalization at eps 1e12 and gain * 1e6 / std (the LN-free GPT-2 layout)."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    inits = {i.name: i for i in out.graph.initializer}
    scaled = set()
    for node in out.graph.node:
        if node.op_type != "LayerNormalization":
            continue
        next(a for a in node.attribute if a.name == "epsilon").f = eps
        if node.input[1] not in scaled:
            g = inits[node.input[1]]
            g.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(g) * np.float32(np.sqrt(eps) * LN_FREE_INV_STD),
                                                g.name))
            scaled.add(node.input[1])
    return out


@pytest.mark.parametrize("source", ["edited", pytest.param("exported", marks=pytest.mark.slow)])
def test_ln_free_gpt2_builds_with_zero_norm_ops(source):
    """disabled_norm folds each eps = 1e12 LayerNorm whole (centering included): no norm op is left."""
    proto = _disable_norms(hf_export("gpt2", 18)) if source == "edited" else hf_export("gpt2", 18, ln_eps=1e12)
    fused, results = run_passes(proto)
    assert _folds(results) == {"disabled_norm": NORMS_PER_MODEL}
    assert not [n for n in fused.graph.node if "Normalization" in n.op_type]
    _equal(proto, fused)
    logits = ort_session(proto).run(["logits"], {"input_ids": np.arange(10, dtype=np.int64).reshape(2, 5)})[0]
    assert np.abs(logits).max() > 0.1          # the norms still scale to unit size: the 1e-5 bound is not vacuous


@pytest.mark.parametrize("kind,opset,fused_ops", [
    ("gpt2", 18, {"SkipLayerNormalization", "LayerNormalization"}),
    pytest.param("llama", 24, {"SimplifiedLayerNormalization"}, marks=pytest.mark.slow)])
def test_ort_optimizer_first_then_gamma_fold(kind, opset, fused_ops, tmp_path):
    """ONNX Runtime's transformers optimizer fuses the norms into its contrib ops; norm_gamma folds their gamma."""
    from onnxruntime.transformers import optimizer
    src = tmp_path / "model.onnx"
    onnx.save(hf_export(kind, opset), src)
    ort_opt = optimizer.optimize_model(str(src), model_type="gpt2", num_heads=2, hidden_size=16, opt_level=2).model
    norm_ops = {n.op_type for n in ort_opt.graph.node if "Normalization" in n.op_type}
    assert norm_ops == fused_ops
    fused, results = run_passes(ort_opt)
    assert _folds(results) == {"norm_gamma": NORMS_PER_MODEL - TIED[kind]}
    _equal(ort_opt, fused)
    verify_pair(ort_opt, fused, atol=FOLD_ATOL_FP32, reference=hf_export(kind, opset))   # vs the unfused export


# Optimum (optimum-onnx) pins transformers < 4.58: it runs in its own environment, named by
# OPTIMUM_PYTHON (see tests/export/optimum_export.py for how to make one).
OPTIMUM_PYTHON = os.environ.get("OPTIMUM_PYTHON")
OPTIMUM_FOLDS = {"gpt2": "norm_gamma", "llama": "channel_scale", "qwen2": "channel_scale", "gpt2-ln-free": "disabled_norm"}


@pytest.mark.slow
@pytest.mark.skipif(not OPTIMUM_PYTHON, reason="OPTIMUM_PYTHON unset: no Python with optimum-onnx (it needs "
                                               "transformers < 4.58; see tests/export/optimum_export.py)")
@pytest.mark.parametrize("kind", list(OPTIMUM_FOLDS))
def test_optimum_exports_fold_and_verify_equal(kind, tmp_path):
    script = Path(__file__).with_name("optimum_export.py")
    subprocess.run([OPTIMUM_PYTHON, str(script), str(tmp_path), kind], check=True, capture_output=True)
    for name, layout, copies in (("model.onnx", "kv-cache", 1), ("decoder_model.onnx", "prefill-only", 1),
                                 ("decoder_model_merged.onnx", "kv-cache", 2)):    # merged: both If branches
        proto = onnx.load(str(tmp_path / kind / name))
        assert detect(proto).name == layout
        fused, results = run_passes(proto)
        tied = TIED[kind] if OPTIMUM_FOLDS[kind] == "norm_gamma" else 0
        assert _folds(results) == {OPTIMUM_FOLDS[kind]: copies * (NORMS_PER_MODEL - tied)}, name
        assert [str(f) for r in results for f in r.skipped if "tied" not in str(f)] == []
        _equal(proto, fused)
    if kind in ("gpt2", "llama"):          # ONNX Runtime's optimizer first: Skip*LayerNormalization ops
        from onnxruntime.transformers import optimizer
        ort_opt = optimizer.optimize_model(str(tmp_path / kind / "model.onnx"), model_type="gpt2", num_heads=2,
                                           hidden_size=16, opt_level=0).model
        skip = "SkipLayerNormalization" if kind == "gpt2" else "SkipSimplifiedLayerNormalization"
        assert sum(n.op_type == skip for n in ort_opt.graph.node) == 2 * N_LAYER
        fused, results = run_passes(ort_opt)
        assert _folds(results) == {"norm_gamma": NORMS_PER_MODEL - TIED[kind]}
        _equal(ort_opt, fused)
