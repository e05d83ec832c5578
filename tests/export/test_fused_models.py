"""torch vs ONNX (unfused) vs ONNX (fused) on every model kind, prefill + decode steps."""
import numpy as np
import pytest

from export.verify import ATOL_FP32, compare, ort_session, read_interface, run_onnx, session_steps
from tests.export.oracle import run_torch
from graph_passes import PassError, run_passes
from graph_passes.base import PassContext
from tests.export.oracle import export_onnx
from tests.export.exported import KINDS, exported
from tests.helpers import random_model

NORMS = ("RMSNormalization", "LayerNormalization")
REAL = [464, 1110, 2402, 257, 640, 612, 373, 257, 1310, 3797, 13]  # a tokenized sentence (ids taken mod vocab)


def _sessions(iface):
    return [("random", session_steps(iface, seed=0)), ("real", session_steps(iface, tokens=REAL))]


@pytest.mark.parametrize("kind", list(KINDS))
def test_fused_matches_torch_and_unfused(kind):
    model, proto, fused, _ = exported(kind)
    iface = read_interface(proto)
    s_unfused, s_fused = ort_session(proto), ort_session(fused)
    for label, steps in _sessions(iface):
        ref = run_torch(model, iface, steps)
        unf = run_onnx(s_unfused, iface, steps)
        fus = run_onnx(s_fused, iface, steps)
        compare(ref, unf, "fp32", f"unfused vs torch, {label}")
        c = compare(ref, fus, "fp32", f"fused vs torch, {label}")
        compare(unf, fus, "fp32", f"fused vs unfused, {label}")
        assert c.max_abs_diff["logits"] <= ATOL_FP32
        assert set(c.max_abs_diff) == {"logits", *(f"present_{n}" for n in iface.cache_names())}


def _taper_nodes(proto):
    ctx = PassContext(proto)
    return [n for n in ctx.graph.nodes if any(c.endswith(".TaperNorm") for c in ctx.module_class(n))]


def test_internal_taper_fused_keeps_only_the_final_norm():
    _, proto, fused, results = exported("internal-taper")
    norms = [n for n in fused.graph.node if n.op_type in NORMS]
    assert len(norms) == 1
    assert _taper_nodes(fused) == []
    assert len(_taper_nodes(proto)) == 2 * model_layers(proto)       # one Mul per TaperNorm before
    folded = {r.name: [l for l, _ in r.rewrites] for r in results}
    assert folded["taper_scale"] == [f"blocks.{i}.ln_{j}" for i in range(2) for j in (1, 2)]
    assert folded["norm_gamma"] == []        # ln_f feeds the tied head: its gamma stays in the norm op
    skipped = [str(f) for r in results if r.name == "norm_gamma" for f in r.skipped]
    assert len(skipped) == 1 and "ln_f" in skipped[0] and "tied" in skipped[0]


def model_layers(proto):
    return int({p.key: p.value for p in proto.metadata_props}["tapernorm.n_layer"])


@pytest.mark.parametrize("kind", ["all-taper", "all-taper-affine-ln-swiglu-untied"])
def test_all_taper_fused_has_no_norm_and_no_taper_op(kind):
    _, proto, fused, results = exported(kind)
    assert not [n for n in fused.graph.node if n.op_type in NORMS]
    assert _taper_nodes(fused) == []
    taper = next(r for r in results if r.name == "taper_scale")
    assert ("ln_f", "scale+shift -> lm_head" if "affine" in kind else "scale -> lm_head") in taper.rewrites
    assert any("gate_proj" in d for _, d in taper.rewrites) == ("swiglu" in kind)


def test_baseline_keeps_rmsnorm_ops_with_gamma_folded():
    from onnx import numpy_helper
    _, proto, fused, _ = exported("baseline")
    norms = [n for n in fused.graph.node if n.op_type == "RMSNormalization"]
    assert len(norms) == 2 * model_layers(proto) + 1
    inits = {i.name: numpy_helper.to_array(i) for i in fused.graph.initializer}
    for n in norms[:-1]:
        assert np.all(inits[n.input[1]] == 1.0), n.name
    # the final norm feeds the head, tied to the embedding: gamma stays in it, so the head's
    # weight is still the embedding's table (one table for export.quantize to store)
    assert not np.all(inits[norms[-1].input[1]] == 1.0)
    head = next(n for n in fused.graph.node if n.op_type == "MatMul" and n.input[0] == norms[-1].output[0])
    table = next(inits[n.input[0]] for n in fused.graph.node if n.op_type == "Gather" and n.input[0] in inits
                 and inits[n.input[0]].ndim == 2)
    assert np.array_equal(inits[head.input[1]], table.T)


def test_gate_above_zero_exports_the_full_blend_and_is_refused():
    model = random_model(norm="taper", taper_scope="internal", gate=0.5)
    import tempfile, pathlib
    proto = export_onnx(model, pathlib.Path(tempfile.mkdtemp()) / "m.onnx")
    ops = {n.op for n in _taper_nodes(proto)}
    assert "RMSNormalization" in ops and "Mul" in ops          # normalized and linear branches
    with pytest.raises(PassError, match="blocks.0.ln_1, blocks.0.ln_2, blocks.1.ln_1, blocks.1.ln_2: TaperNorm gate 0.5"):
        run_passes(proto)


def test_fp16_export_fuses_and_matches_torch_fp16():
    import copy
    import torch
    model, proto, fused, results = exported("internal-taper", "fp16")
    iface = read_interface(fused)
    assert iface.dtype == "fp16"
    assert [l for r in results if r.name == "taper_scale" for l, _ in r.rewrites] == \
        [f"blocks.{i}.ln_{j}" for i in range(2) for j in (1, 2)]
    ref_model = copy.deepcopy(model).to(torch.float16)
    steps = session_steps(iface, seed=3)
    ref = run_torch(ref_model, iface, steps)
    compare(ref, run_onnx(ort_session(proto), iface, steps), "fp16", "unfused fp16 vs torch fp16")
    compare(ref, run_onnx(ort_session(fused), iface, steps), "fp16", "fused fp16 vs torch fp16")
