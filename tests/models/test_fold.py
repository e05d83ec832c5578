"""models/fold.py: the torch-side fold keeps the logits (fp32 reassociation only) and leaves
only the scale-free core of each norm."""
import pytest
import torch

from models.fold import FOLDED_NORM_CLASSES, fold_norms
from tests.helpers import random_model


@pytest.mark.parametrize("kind", [dict(norm="rmsnorm"), dict(norm="taper", taper_scope="internal"),
                                  dict(norm="taper", taper_scope="all"), dict(norm="dyt"),
                                  dict(norm="layernorm")])
def test_fold_keeps_logits(kind):
    gate = 0.0 if kind["norm"] == "taper" else None
    model = random_model(seed=3, gate=gate, **kind)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 7))
    with torch.no_grad():
        ref = model(ids)
        folded = fold_norms(model)
        got = folded(ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)        # fp32 reassociation only
    assert not any(type(m).__name__ in ("TaperNorm", "RMSNorm", "DyT", "LayerNorm") for m in folded.modules())
    assert any(isinstance(m, FOLDED_NORM_CLASSES) for m in folded.modules()) == (kind["norm"] != "taper"
                                                                                 or kind["taper_scope"] == "internal")
    assert model(ids).shape == ref.shape                               # the original is left alone
    cache = folded.cfg.cache_layout().allocate(2)
    with torch.no_grad():
        step, _ = folded(ids, torch.zeros(2, dtype=torch.long), cache)
    torch.testing.assert_close(step, ref, atol=1e-5, rtol=1e-4)


def test_tied_head_is_untied_and_embedding_unscaled():
    model = random_model(seed=0, norm="rmsnorm")
    folded = fold_norms(model)
    assert folded.lm_head.weight is not folded.wte.weight
    torch.testing.assert_close(folded.wte.weight, model.wte.weight, rtol=0, atol=0)
    torch.testing.assert_close(folded.lm_head.weight, model.wte.weight * model.ln_f.weight[None, :])


def test_taper_above_gate_zero_is_refused():
    model = random_model(seed=0, norm="taper", taper_scope="internal", gate=0.5)
    with pytest.raises(ValueError, match="gate 0.5"):
        fold_norms(model)


# the 2026 families' norm layouts: QK-norms (per head, per projection), sandwich and post norms
FAMILY_LAYOUTS = {"qwen3": dict(qk_norm="head", n_kv_head=2), "gemma3": dict(norm_layout="sandwich", qk_norm="head"),
                  "olmo2": dict(norm_layout="post", qk_norm="proj", n_kv_head=2)}


@pytest.mark.parametrize("layout", list(FAMILY_LAYOUTS))
@pytest.mark.parametrize("kind", [dict(norm="rmsnorm"), dict(norm="taper", taper_scope="all"),
                                  dict(norm="taper", taper_scope="all", taper_affine=True)], ids=["rms", "taper", "affine"])
def test_fold_of_the_families_norms_keeps_logits(layout, kind):
    gate = 0.0 if kind["norm"] == "taper" else None
    model = random_model(seed=5, gate=gate, pos_embedding="rope", mlp="swiglu", **FAMILY_LAYOUTS[layout], **kind)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 7))
    with torch.no_grad():
        ref = model(ids)
        folded = fold_norms(model)
        got = folded(ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    left = [n for n, m in folded.named_modules() if type(m).__name__ in ("TaperNorm", "RMSNorm")]
    # tapered: nothing is left; live: the QK-norms and post norms stay whole (nothing follows them to fold into)
    expected = [] if kind["norm"] == "taper" else [n for n in model.cfg.norm_names()
                                                   if n.endswith(("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"))]
    assert left == expected


def test_folded_norm_names_are_what_the_fold_folds():
    from models.fold import folded_norm_names
    live = random_model(seed=1, norm="rmsnorm", pos_embedding="rope", mlp="swiglu", norm_layout="sandwich", qk_norm="head")
    assert folded_norm_names(live) == [n for n in live.cfg.norm_names()
                                       if n.endswith(("ln_1", "ln_2"))]          # ln_f: kept, it feeds the tied head
    taper = random_model(seed=1, gate=0.0, norm="taper", taper_scope="all", pos_embedding="rope", mlp="swiglu",
                         norm_layout="sandwich", qk_norm="head")
    assert folded_norm_names(taper) == taper.cfg.norm_names()
