"""The 2026 families' norms through export and graph_passes (issue 34): on random architectures of every
family (QK-norms per head and per projection, sandwich and post norms, Gemma's scales and soft-caps,
sliding-window layers with a local rope base, NoPE layers, partial rope, yarn and longrope), the folded
graph equals the unfolded one within fp32 1e-5 on every output (logits and every cache written), an
all-taper build at g = 0 has no normalization op left (internal-taper: the final norm only), and a live
RMSNorm model keeps each QK-norm and post norm as an op, said per norm in the pass report."""
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from tests.export.oracle import export_onnx
from export.verify import ort_session, read_interface, run_onnx, session_steps
from graph_passes import run_passes
from tests.graph_passes.fixtures import ops
from tests.helpers import random_model

ATOL_FOLD_FP32 = 1e-5     # issue 34: folded == unfolded within fp32 1e-5 (a fold only reassociates products)
NORM_OPS = ("RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization")
FAMILIES = {
    "qwen3": dict(qk_norm="head", n_kv_head=2, head_size=8, qkv_bias=False, out_bias=False, mlp_bias=False),
    "qwen3-yarn-sliding": dict(qk_norm="head", sliding_window=3, sliding_layers=[1],
                               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    "gemma": dict(embed_scale=4.0, activation="gelu_new", n_kv_head=1),
    "gemma2": dict(norm_layout="sandwich", attn_scale=0.3, attn_softcap=3.0, final_softcap=5.0, sliding_window=3,
                   sliding_layers=[0], activation="gelu_new"),
    "gemma3": dict(norm_layout="sandwich", qk_norm="head", attn_scale=0.3, sliding_window=3, sliding_layers=[0],
                   local_rope_theta=100.0, embed_scale=4.0, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "phi3-longrope": dict(rotary_dim=4, rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5],
                                                     "long_factor": [2.0, 4.0], "factor": 4.0,
                                                     "original_max_position_embeddings": 5}),
    "olmo2": dict(norm_layout="post", qk_norm="proj", n_kv_head=2),
    "smollm3": dict(nope_layers=[1]),
    "granite": dict(embed_scale=2.0, attn_scale=0.2, residual_scale=0.5, logits_divisor=3.0),
}


@st.composite
def archs(draw):
    family = draw(st.sampled_from(sorted(FAMILIES)))
    norm = draw(st.sampled_from(["taper", "taper", "rmsnorm"]))
    cfg = dict(d_model=16, n_head=2, n_layer=2, vocab_size=draw(st.sampled_from([64, 97])), max_seq_len=16,
               pos_embedding="rope", mlp="swiglu", tie_embeddings=draw(st.booleans()), norm=norm, **FAMILIES[family])
    if norm == "taper":
        cfg.update(taper_scope=draw(st.sampled_from(["internal", "all"])), taper_affine=draw(st.booleans()), gate=0.0)
    return family, cfg, draw(st.integers(0, 1000))


def _outputs(proto, seed):
    iface = read_interface(proto)
    steps = session_steps(iface, seed=seed, prompt=6, decode=4)      # past the window (3) and longrope's switch (5)
    return run_onnx(ort_session(proto), iface, steps)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])     # no shrinking: an export is seconds
@given(archs())
def test_folded_equals_unfolded_on_random_archs_of_every_family(case):
    family, cfg, seed = case
    model = random_model(seed=seed, **cfg)
    proto = export_onnx(model, None)
    fused, results = run_passes(proto)
    before, after = _outputs(proto, seed), _outputs(fused, seed)       # per step: every output by name
    assert len(before) == len(after)
    for step_a, step_b in zip(before, after):
        for name in step_a:
            np.testing.assert_allclose(step_b[name], step_a[name], atol=ATOL_FOLD_FP32, rtol=0,
                                       err_msg=f"{family} {cfg} {name}")
    norms = sum(o in NORM_OPS for o in ops(fused))
    if cfg["norm"] == "taper":
        assert norms == (1 if cfg["taper_scope"] == "internal" else 0), (family, cfg, ops(fused))
    else:
        stays = [n for n in model.cfg.norm_names() if n.endswith(("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"))]
        assert norms == len(model.cfg.norm_names())
        notes = {f.where: f.why for r in results for f in r.findings}
        for name in stays:
            assert ("QK-norm" if name.endswith(("q_norm", "k_norm")) else "post-sublayer norm") in notes.get(name, ""), \
                (family, name, notes)
