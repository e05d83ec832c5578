"""Property-based sweep: fused vs torch max |d logits| <= 1e-4 (fp32) over random shapes."""
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

from tests.export.oracle import export_onnx
from export.verify import ATOL_FP32, compare, ort_session, read_interface, run_onnx, session_steps
from tests.export.oracle import run_torch
from graph_passes import run_passes
from tests.graph_passes.fixtures import ops
from tests.helpers import random_model


@st.composite
def configs(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    width = heads * draw(st.sampled_from([4, 8, 12]))
    norm = draw(st.sampled_from(["taper", "taper", "rmsnorm", "layernorm", "dyt"]))
    cfg = dict(d_model=width, n_head=heads, n_layer=draw(st.integers(1, 2)), vocab_size=draw(st.sampled_from([64, 97])),
               max_seq_len=16, tie_embeddings=draw(st.booleans()), mlp=draw(st.sampled_from(["gelu", "swiglu"])),
               mlp_ratio=draw(st.sampled_from([1, 2])), norm=norm)
    if norm == "taper":
        cfg.update(taper_scope=draw(st.sampled_from(["internal", "all"])), taper_affine=draw(st.booleans()),
                   taper_base=draw(st.sampled_from(["rms", "ln"])), gate=0.0)
    return cfg, draw(st.integers(0, 1000))


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(configs())
def test_fused_matches_torch_on_random_shapes(case):
    cfg, seed = case
    model = random_model(seed=seed, **cfg)
    proto = export_onnx(model, Path(tempfile.mkdtemp()) / "m.onnx")
    fused, _ = run_passes(proto)
    iface = read_interface(fused)
    steps = session_steps(iface, seed=seed, prompt=4, decode=2)
    c = compare(run_torch(model, iface, steps), run_onnx(ort_session(fused), iface, steps), "fp32", str(cfg))
    assert c.max_abs_diff["logits"] <= ATOL_FP32
    if cfg["norm"] == "taper":
        n_norm = sum(o in ("RMSNormalization", "LayerNormalization") for o in ops(fused))
        assert n_norm == (1 if cfg["taper_scope"] == "internal" else 0)
