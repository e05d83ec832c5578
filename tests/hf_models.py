"""Tiny random-init Hugging Face models, built with transformers in the test (no download).

Every parameter is randomized (norm gains around 1, biases around 0, matrices at
std 0.2 so that logits are O(5) and greedy top-2 ties are rare): a converter that
drops a bias or a norm gain, or maps a tensor to the wrong place, cannot pass a
numerical test.
"""
from __future__ import annotations

from pathlib import Path

import pytest

FAKELN_EPS = 1e12          # the eps of Baroni et al.'s published LN-free GPT-2 folders
FAKELN_STD = 1.7           # the frozen std their gains divide by (any positive number will do here)
VOCAB = 320                # fits tests.helpers.tiny_tokenizer_json (300 tokens)

FAMILIES = {
    # name: (model_type, config overrides)
    "gpt2": ("gpt2", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "gpt2-fakeln": ("gpt2", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, layer_norm_epsilon=FAKELN_EPS)),
    "llama": ("llama", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64)),
    "qwen2": ("qwen2", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64)),
    "mistral": ("mistral", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=16, max_position_embeddings=64, sliding_window=None)),
    # the less common options, conversion-checked: untied GPT-2 with an integer n_inner and erf GELU,
    # Llama with every bias, a tied head and llama3 rope scaling
    "gpt2-untied": ("gpt2", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=False, n_inner=40,
                                 activation_function="gelu")),
    "llama-bias-llama3": ("llama", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                             low_freq_factor=1.0, high_freq_factor=4.0,
                                                             original_max_position_embeddings=16))),
    # the 2026 families (issue 34), each with what its real checkpoints use
    "qwen3": ("qwen3", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)),
    "qwen3-yarn-sliding": ("qwen3", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=64, use_sliding_window=True, sliding_window=7,
                                         max_window_layers=1,
                                         rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                              original_max_position_embeddings=16))),
    "gemma": ("gemma", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=1, head_dim=16, max_position_embeddings=64)),
    "gemma2": ("gemma2", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=7,
                              query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),
    "gemma3": ("gemma3_text", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=7,
                                   query_pre_attn_scalar=24, final_logit_softcapping=20.0,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                   rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10.0),
                                                    "full_attention": dict(rope_type="linear", factor=4.0,
                                                                           rope_theta=1000.0)})),
    "phi3": ("phi3", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=64,
                          partial_rotary_factor=0.5, pad_token_id=0)),
    # longrope beyond its pretraining length (16): the long factors from position 16 on, as transformers switches
    "phi3-longrope": ("phi3", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                                   original_max_position_embeddings=16,
                                   rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                        partial_rotary_factor=0.75,
                                                        short_factor=[1.0, 1.3, 1.7], long_factor=[2.0, 3.1, 5.3]))),
    "olmo2": ("olmo2", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)),
    "smollm3": ("smollm3", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=64, no_rope_layer_interval=2,
                                pad_token_id=0)),
    "granite": ("granite", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=64, embedding_multiplier=2.0,
                                attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=4.0)),
}


def transformers_classes(model_type: str):
    transformers = pytest.importorskip("transformers")
    names = {"gpt2": ("GPT2Config", "GPT2LMHeadModel"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "gemma": ("GemmaConfig", "GemmaForCausalLM"),
             "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
             "phi3": ("Phi3Config", "Phi3ForCausalLM"), "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
             "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
             "granite": ("GraniteConfig", "GraniteForCausalLM")}[model_type]
    return getattr(transformers, names[0]), getattr(transformers, names[1])


def hf_model(name: str, seed: int = 0, **changes):
    """The transformers model (eval mode) of FAMILIES[name] (config fields `changes` changed), every
    parameter randomized."""
    import torch
    model_type, overrides = FAMILIES[name]
    config_cls, model_cls = transformers_classes(model_type)
    torch.manual_seed(seed)
    config = config_cls(vocab_size=VOCAB, **{**overrides, **changes})
    config.initializer_range = 0.2
    model = model_cls(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in pname or "ln_" in pname) and pname.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
        if name == "gpt2-fakeln":     # the eps trick: LN(x) ~ (x - mean) * gamma / std, written as gamma * 1e6 / std
            for m in model.modules():
                if isinstance(m, torch.nn.LayerNorm):
                    m.weight.mul_(FAKELN_EPS ** 0.5 / FAKELN_STD)
    return model


def save_hf(model, path: Path, tokenizer: bool = False, **save_kwargs) -> Path:
    """save_pretrained into `path` (config.json, model.safetensors, ...), optionally with a tokenizer.json."""
    import contextlib
    import io
    with contextlib.redirect_stderr(io.StringIO()):   # transformers' shard-writing progress bar
        model.save_pretrained(path, **save_kwargs)
    if tokenizer:
        from tests.helpers import tiny_tokenizer_json
        tiny_tokenizer_json(path / "tokenizer.json")
    return path


def our_cached_logits(model, ids, prefill: int):
    """Our decoder's logits [B, T, V]: `prefill` tokens, then one token a call through its KV cache (the
    twin of export.transformers_check.transformers_cached_logits, for the tests that compare the two)."""
    import torch
    with torch.no_grad():
        cache = model.cfg.cache_layout().allocate(ids.shape[0])
        logits, cache = model(ids[:, :prefill], torch.zeros(ids.shape[0], dtype=torch.long), cache)
        out = [logits]
        for t in range(prefill, ids.shape[1]):
            logits, cache = model(ids[:, t:t + 1], torch.full((ids.shape[0],), t), cache)
            out.append(logits)
    return torch.cat(out, 1)
