"""Acceptance on the trained zoo (skipped where models/zoo/<name> is absent).

Export, fuse, check the structure the issue promises and fused vs torch <= 1e-4:
internal-taper keeps exactly one norm (the final one) and no TaperNorm op;
all-taper keeps none; the baseline keeps its RMSNormalization ops with gamma = 1.
The GPT-2-architecture fine-tunes (train.finetune): All-TaperLN keeps none,
Internal-TaperLN only ln_f, FakeLN none once graph_passes has `disabled_norm`.
"""
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

ZOO = Path(os.environ.get("TAPERNORM_ZOO", Path(__file__).resolve().parents[2] / "models" / "zoo"))
NORMS = ("RMSNormalization", "LayerNormalization")


def _has_pass(name: str) -> bool:
    from graph_passes import DEFAULT_PASSES, PASSES
    return name in PASSES and name in DEFAULT_PASSES


@pytest.mark.slow
@pytest.mark.parametrize("name", ["internal-taper", "all-taper", "baseline", "dyt", "gpt2-all-taperln",
                                  "gpt2-internal-taperln", "gpt2-fakeln", "qwen3", "qwen3-all-taper", "gemma3",
                                  "gemma3-all-taper"])
def test_zoo_fused_structure_and_logits(name):
    ckpt = ZOO / name
    if not (ckpt / "config.json").is_file():
        pytest.skip(f"zoo model {name!r} is absent ({ckpt})")
    if name == "gpt2-fakeln" and not _has_pass("disabled_norm"):
        pytest.skip("graph_passes has no 'disabled_norm' pass in its default passes yet (issue 12 writes it): "
                    "the FakeLN model's eps-1e12 LayerNorms stay")
    from tests.export.oracle import export_onnx
    from export.verify import ATOL_FP32, compare, ort_session, read_interface, run_onnx, session_steps
    from tests.export.oracle import rounding_slack, run_torch
    from graph_passes import run_passes
    from graph_passes.base import PassContext
    from models.checkpoint import load_checkpoint, load_tokenizer

    model = load_checkpoint(ckpt)
    proto = export_onnx(model, Path(tempfile.mkdtemp()) / "model.onnx")
    fused, _ = run_passes(proto)
    ctx = PassContext(fused)
    norms = [n for n in ctx.graph.nodes if n.op in NORMS]
    tapers = [n for n in ctx.graph.nodes if any(c.endswith(".TaperNorm") for c in ctx.module_class(n))]
    assert tapers == []
    if name in ("internal-taper", "gpt2-internal-taperln"):
        assert [ctx.layer_name(n) for n in norms] == ["ln_f"]
    elif name in ("all-taper", "dyt", "gpt2-all-taperln", "gpt2-fakeln", "qwen3-all-taper", "gemma3-all-taper"):
        assert norms == []
    elif name in ("qwen3", "gemma3"):       # live: the pre-norms' gamma folded, the QK-norms' and post norms' kept
        assert len(norms) == len(model.cfg.norm_names())
        for n in norms:
            live = ctx.layer_name(n).endswith(("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm", "ln_f"))
            assert np.all(np.asarray(n.inputs[1].values) == 1.0) != live, ctx.layer_name(n)
    else:
        assert len(norms) == 2 * model.cfg.n_layer + 1
        for n in norms:
            assert np.all(np.asarray(n.inputs[1].values) == 1.0), ctx.layer_name(n)
    iface = read_interface(fused)
    tokens = load_tokenizer(ckpt).encode("Once upon a time there was a little cat named Tom.").ids
    for steps in (session_steps(iface, seed=0), session_steps(iface, tokens=tokens)):
        # compare raises past the build's own bound: fp32's, plus what rounding alone moves this model by on these
        # inputs (export.verify.rounding_slack: a norm-free Gemma 3 on random tokens reaches logits of ~4600)
        ref = run_torch(model, iface, steps)
        c = compare(ref, run_onnx(ort_session(fused), iface, steps), "fp32", name,
                    slack=rounding_slack(model, iface, steps, ref))
    assert c.max_abs_diff["logits"] <= ATOL_FP32          # on real text (the last session): the fixed bound, every model
