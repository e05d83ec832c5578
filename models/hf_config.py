"""The DecoderConfig of a Hugging Face config.json: GPT-2's layout, and Llama's with what a family adds.

`gpt2_config` reads GPT-2's keys; `llama_config` reads every other family's, with what its
record in models/families.py says (norm layout, q/k norms, activation key, and its rules for
biases, sliding layers, NoPE layers and constant factors). The fields come through
models/hf_fields.ConfigFields (defaults, one-line refusals), the rope through models/hf_rope.py.
"""
from __future__ import annotations

from models.decoder import DecoderConfig
from models.hf_fields import LAYER_TYPES, ConfigFields, kv_capacity
from models.hf_rope import rope_fields

def gpt2_config(f: ConfigFields, max_seq_len: int | None) -> DecoderConfig:
    """GPT-2: LayerNorm, learned positions, biases everywhere; the options the decoder lacks refused."""
    if not f.get("scale_attn_weights"):
        f.unsupported("scale_attn_weights false")
    if f.get("scale_attn_by_inverse_layer_idx"):
        f.unsupported("scale_attn_by_inverse_layer_idx")
    if f.get("add_cross_attention"):
        f.unsupported("add_cross_attention (an encoder-decoder GPT-2)")
    d, heads = f.int("n_embd"), f.int("n_head")
    if d % heads:
        f.refuse("n_head", heads, f"a divisor of n_embd ({d})")
    eps = f.number("layer_norm_epsilon")
    return DecoderConfig(vocab_size=f.int("vocab_size"), d_model=d, n_layer=f.int("n_layer"), n_head=heads,
                         max_seq_len=kv_capacity(f, "n_positions", max_seq_len), mlp="gelu", norm="layernorm",
                         tie_embeddings=bool(f.get("tie_word_embeddings")), eps=eps,
                         mlp_hidden=f.int("n_inner", allow_none=True), activation=f.activation("activation_function"),
                         pos_embedding="learned", qkv_bias=True, out_bias=True, mlp_bias=True)


def _layer_types(f: ConfigFields, n_layer: int, nope: list[int]) -> list[str]:
    """Each layer's attention kind: config.json's layer_types, else as the family's config class derives it
    (its record's `sliding` rule)."""
    raw = f.raw.get("layer_types")
    if raw is not None:
        if not (isinstance(raw, list) and len(raw) == n_layer and all(t in LAYER_TYPES for t in raw)):
            f.refuse("layer_types", raw, f"a list of {n_layer} of {', '.join(LAYER_TYPES)}")
        return list(raw)
    return ["sliding_attention" if s else "full_attention" for s in f.family.sliding(f, n_layer, nope)]


def llama_config(f: ConfigFields, max_seq_len: int | None) -> DecoderConfig:
    """Every family but GPT-2: Llama's layout with what the family's record (f.family) adds."""
    family = f.family
    d, heads, n_layer = f.int("hidden_size"), f.int("num_attention_heads"), f.layers("num_hidden_layers")
    kv = f.int("num_key_value_heads", allow_none=True) or heads
    head_dim = f.int("head_dim", allow_none=True) or d // heads
    if f.get("head_dim") is None and d % heads:
        f.refuse("num_attention_heads", heads, f"a divisor of hidden_size ({d})")
    if heads % kv:
        f.refuse("num_key_value_heads", kv, f"a divisor of num_attention_heads ({heads})")
    eps = f.number("rms_norm_eps")
    capacity = kv_capacity(f, "max_position_embeddings", max_seq_len)
    nope = family.nope_layers(f, n_layer)
    local = [i for i, t in enumerate(_layer_types(f, n_layer, nope)) if t == "sliding_attention"]
    window = f.int("sliding_window") if local else None
    # a window that covers the whole cache is plain causal attention: no mask; the layers stay local
    # for their rope base (Gemma 3's rope_local_base_freq), which does not depend on the mask
    sliding = [] if window is None or window >= capacity else local
    window = window if sliding else None
    act = f.get(family.act_key)     # a legacy name the family's config class reads as another activation
    activation = family.act_aliases[act] if isinstance(act, str) and act in family.act_aliases else \
        f.activation(family.act_key)
    return DecoderConfig(vocab_size=f.int("vocab_size"), d_model=d, n_layer=n_layer, n_head=heads,
                         n_kv_head=None if kv == heads else kv, head_size=None if head_dim * heads == d else head_dim,
                         max_seq_len=capacity, mlp="swiglu", norm="rmsnorm",
                         tie_embeddings=bool(f.get("tie_word_embeddings")), eps=eps,
                         mlp_hidden=f.int("intermediate_size"), activation=activation,
                         norm_layout=family.norm_layout, qk_norm=family.qk_norm, sliding_window=window,
                         sliding_layers=sliding, nope_layers=nope,
                         **rope_fields(f, head_dim, local, capacity), **family.biases(f), **_scales(f, d))


def _scales(f: ConfigFields, d: int) -> dict:
    """The constant factors (DecoderConfig's embed_scale, attn_scale, ...): Gemma's sqrt(d) embedding scale,
    then the family's own rule."""
    out = {"embed_scale": d ** 0.5} if f.family.scaled_embedding else {}
    return {**out, **f.family.scales(f)}
