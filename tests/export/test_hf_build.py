"""export.build --fuse --checkpoint HF_DIR on tiny random-init transformers models (no download).

For GPT-2, LN-free GPT-2 (eps trick), Llama (GQA) and Qwen2 (q/k/v biases, GQA): the build
converts each tensor as it is read and says so, the fused graph matches torch within 1e-4 (fp32;
the build's own verification, read back from report.json), and ONNX Runtime's greedy 32 tokens
equal transformers' `generate`. The LN-free build reports its eps approximation error, and has no
LayerNormalization op once graph_passes has the `disabled_norm` fold (issue 12).
"""
import json

import numpy as np
import pytest
import torch

from tests.hf_models import hf_model, save_hf
from tests.runtime.greedy import compare_greedy

GREEDY_TOKENS = 32
PROMPT = [5, 17, 42, 99, 7, 250, 3]
# The default run builds two (each build is emit + fold + write + ORT verification, the heaviest thing here): the
# LN-free GPT-2 (gpt2 conversion, learned positions, the disabled-norm fold, real-text verification with a
# tokenizer) and Qwen2 (rope, GQA cache, q/k/v biases, no tokenizer); GPT-2 and Llama run with -m slow.
# Mistral: conversion-checked (tests/models/test_convert.py).
BUILT = [pytest.param("gpt2", marks=pytest.mark.slow), "gpt2-fakeln", pytest.param("llama", marks=pytest.mark.slow),
         "qwen2"]
WITH_TOKENIZER = {"gpt2", "gpt2-fakeln"}


def _has_pass(name: str) -> bool:
    from graph_passes import DEFAULT_PASSES, PASSES
    return name in PASSES and name in DEFAULT_PASSES


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (transformers model, build dir, log lines), built once per module on first use."""
    from export.options import BuildOptions
    from export.pipeline import build
    root = tmp_path_factory.mktemp("hf_build")
    cache = {}

    def get(name):
        if name not in cache:
            hf = hf_model(name)
            folder = save_hf(hf, root / name, tokenizer=(name in WITH_TOKENIZER))
            lines = []
            build(folder, root / f"{name}.build", BuildOptions(fuse=True), log=lines.append)
            cache[name] = (hf, root / f"{name}.build", lines)
        return cache[name]
    return get


@pytest.mark.parametrize("name", BUILT)
def test_build_converts_as_it_reads_and_fused_matches_torch(built, name):
    _, out, lines = built(name)
    report = json.loads((out / "report.json").read_text())
    model_type = name.split('-')[0]
    assert report["source"] == f"hf:{model_type}" and report["graph"] == "model.fused.onnx"
    assert lines[0].startswith("[1/5] open ") and f"(a Hugging Face {model_type} folder, converted as it is read)" \
        in lines[0]
    assert set(report["max_abs_diff"]) == {"graph_vs_torch"}
    worst = max(v for per in report["max_abs_diff"]["graph_vs_torch"].values() for v in per.values())
    assert 0 < worst <= report["atol"] == 1e-4, worst
    config = json.loads((out / "config.json").read_text())
    assert config["format"] == 3 and config["has_tokenizer"] == (name in WITH_TOKENIZER)
    assert (out / "tokenizer.json").is_file() == (name in WITH_TOKENIZER)
    if name in WITH_TOKENIZER:   # with a tokenizer the build also verified on real text
        assert any("real tokens" in k for k in report["max_abs_diff"]["graph_vs_torch"])
    else:
        assert any("generation needs" in n for n in report["notes"])


@pytest.mark.parametrize("name", BUILT)
def test_ort_greedy_equals_transformers_generate(built, name):
    from runtime.generate import GenerationConfig, generate
    from runtime.ort_session import OrtSession
    hf, out, _ = built(name)
    # no stop token on either side: the model's own generation config names one (e.g. Mistral's id 2), and
    # min_new_tokens would suppress it rather than let greedy pick it
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True)
    ref_tokens = ref.sequences[0, len(PROMPT):].tolist()
    ref_logits = [s[0].numpy() for s in ref.scores]
    with OrtSession(out / "model.fused.onnx") as session:
        got = generate(session, [PROMPT], GenerationConfig(max_new_tokens=GREEDY_TOKENS, keep_logits=True))
    assert len(ref_tokens) == GREEDY_TOKENS
    compared = compare_greedy(ref_tokens, ref_logits, got.tokens[0], [row[0] for row in got.logits])
    assert compared == GREEDY_TOKENS, f"streams diverged at a tie after {compared} tokens"


def test_ln_free_gpt2_reports_the_eps_approximation(built):
    _, out, lines = built("gpt2-fakeln")
    eps = json.loads((out / "report.json").read_text())["eps_approximation"]
    assert eps["layers"] == 5 and eps["eps"] == 1e12 and eps["tokens"] > 0
    # var(x) / (2 eps) with eps 1e12 and O(1)-O(100) activations: far below fp32 resolution, yet measured (> 0)
    assert 0 < eps["worst_rel_error"] < 1e-8 and 0 <= eps["max_abs_logit_diff"] < 1e-6
    assert any(line.strip().startswith("eps") and "var(x)/(2 eps)" in line for line in lines)


def test_ln_free_gpt2_fused_has_no_layernorm(built):
    if not _has_pass("disabled_norm"):
        pytest.skip("graph_passes has no 'disabled_norm' pass in its default passes yet (issue 12 writes it)")
    _, out, _ = built("gpt2-fakeln")
    report = json.loads((out / "report.json").read_text())
    assert report["op_counts"]["emitted"].get("LayerNormalization") == 5       # the graph as emitted, before the fold
    assert report["op_counts"]["fused"].get("LayerNormalization", 0) == 0 and report["norm_ops"]["fused"] == 0


def test_eps_approximation_is_measured_not_assumed():
    """The linear limit of a disabled norm differs from the norm by ~var(x)/(2 eps): check the figure on a
    norm whose eps is small enough (1e6) for the difference to show in float64."""
    from models.disabled_norm import LinearLimit, approximation_error
    from tests.helpers import random_model
    model = random_model(norm="layernorm", eps=1e6)
    with torch.no_grad():
        for m in model.modules():
            if m.__class__.__name__ == "LayerNorm":
                m.weight.mul_(1e3)          # gamma * sqrt(eps) / std with std ~ 1
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    approx = approximation_error(model, [ids])
    assert approx.layers == 5 and approx.worst_layer in {n for n, _ in model.named_modules()}
    x = torch.randn(4, 32, dtype=torch.float64) * 30
    norm = model.blocks[0].ln_1.double()
    with torch.no_grad():
        rel = ((norm(x) - norm.bias) / (LinearLimit(norm)(x) - norm.bias) - 1).abs().max()
    predicted = (x.var(dim=-1, unbiased=False) / (2 * norm.eps)).max()
    assert float(rel) == pytest.approx(float(predicted), rel=0.01)     # the first-order formula holds
    assert approx.worst_rel_error > 0 and approx.max_abs_logit_diff > 0
    assert np.isfinite(approx.max_abs_logit_diff)
