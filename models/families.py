"""One record per Hugging Face model_type: everything the converter knows of a family, in one place.

A `Family` holds the family's transformers defaults (a saved config.json may leave a default out;
tests/models/test_convert.py checks them against transformers' config classes), its weight layout
(GPT-2's or Llama's, `Layout`: tensor names and what they become), its norm kind and layout, how its
config class reads rope and activations, and small rules for what its config class computes
(biases, sliding layers, NoPE layers, constant factors). The converter's modules read the record
(models/hf_config.py, models/hf_rope.py, models/hf_layout.py, models/convert.py), never the
model_type: adding a family is one record below, plus its tiny folder in tests/hf_models.py
(tests/models/test_families.py checks both).

    gpt2     LayerNorm, learned positions, Conv1D weights, gelu_new, tied head
    llama    RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP; optional biases
    mistral  sliding window on every layer; no biases
    qwen2    q/k/v biases; use_sliding_window past max_window_layers
    qwen3    per-head q_norm / k_norm before rope
    gemma    (1 + w) RMSNorm gains, embeddings x sqrt(d), GeGLU
    gemma2   sandwich norms, query_pre_attn_scalar, attention and final soft-caps, alternate sliding layers
    gemma3_text  gemma2 + q_norm / k_norm, 5 local : 1 global layers, rope per layer type
    phi3     fused qkv_proj / gate_up_proj, partial_rotary_factor, longrope (legacy names su / yarn)
    olmo2    post-norms only, q_norm / k_norm over the whole projection
    smollm3  NoPE layers
    granite  embedding / attention / residual multipliers, logits_scaling
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from models.decoder import DecoderConfig
from models.hf_config import gpt2_config, llama_config
from models.hf_fields import ConfigFields
from models.hf_files import ConvertError
from models.hf_layout import Param, gpt2_params, llama_params


@dataclass(frozen=True)
class Layout:
    """How a folder's tensors are named and shaped: GPT-2's, or Llama's (every other family's)."""
    name: str                   # what refusals call a model of this layout
    embedding: str              # the embedding's name, which tells the layouts apart
    prefixes: tuple[str, ...]   # the base model's prefixes its names may carry, save_pretrained's first
    decoder_config: Callable[[ConfigFields, int | None], DecoderConfig]
    params: Callable[[ConfigFields, DecoderConfig], list[Param]]


GPT2_LAYOUT = Layout("gpt2", "wte.weight", ("transformer.", ""), gpt2_config, gpt2_params)
LLAMA_LAYOUT = Layout("llama-like", "embed_tokens.weight", ("model.", ""), llama_config, llama_params)
LAYOUTS = (GPT2_LAYOUT, LLAMA_LAYOUT)


# --- the rules that differ by family (each takes the config's fields) -----------------------

def attention_bias(f: ConfigFields) -> dict:
    """attention_bias on q/k/v and the output projection; no MLP biases."""
    attn = bool(f.get("attention_bias"))
    return dict(qkv_bias=attn, out_bias=attn, mlp_bias=False)


def attention_and_mlp_bias(f: ConfigFields) -> dict:
    """attention_bias as above, and mlp_bias on the three MLP projections (Llama, Granite, SmolLM3)."""
    return {**attention_bias(f), "mlp_bias": bool(f.get("mlp_bias"))}


def qkv_bias_only(f: ConfigFields) -> dict:
    """Qwen2: q/k/v always biased, nothing else (no config key)."""
    return dict(qkv_bias=True, out_bias=False, mlp_bias=False)


def no_bias(f: ConfigFields) -> dict:
    """Mistral, Phi-3: no biases (no config key)."""
    return dict(qkv_bias=False, out_bias=False, mlp_bias=False)


def no_sliding(f: ConfigFields, n_layer: int, nope: list[int]) -> list[bool]:
    return [False] * n_layer


def sliding_everywhere(f: ConfigFields, n_layer: int, nope: list[int]) -> list[bool]:
    """Mistral, Phi-3: every layer slides when sliding_window is set."""
    return [f.get("sliding_window") is not None] * n_layer


def sliding_past_max_window_layers(f: ConfigFields, n_layer: int, nope: list[int]) -> list[bool]:
    """Qwen2, Qwen3: with use_sliding_window, the layers from max_window_layers on."""
    on = bool(f.get("use_sliding_window")) and f.get("sliding_window") is not None
    first = f.get("max_window_layers")     # 0: every layer slides (transformers takes it)
    if on and (isinstance(first, bool) or not isinstance(first, int) or first < 0):
        f.refuse("max_window_layers", first, "a non-negative integer")
    return [on and i >= first for i in range(n_layer)]


def sliding_alternate(f: ConfigFields, n_layer: int, nope: list[int]) -> list[bool]:
    """Gemma 2: layers 0, 2, 4, ... slide."""
    return [bool((i + 1) % 2) for i in range(n_layer)]


def sliding_but_every_pattern_th(f: ConfigFields, n_layer: int, nope: list[int]) -> list[bool]:
    """Gemma 3: every sliding_window_pattern-th layer (6th by default) is global, the others slide."""
    pattern = f.int("sliding_window_pattern") if "sliding_window_pattern" in f.raw else 6
    return [bool((i + 1) % pattern) for i in range(n_layer)]


def sliding_nope_layers(f: ConfigFields, n_layer: int, nope: list[int]) -> list[bool]:
    """SmolLM3: with use_sliding_window, its NoPE layers slide."""
    on = bool(f.get("use_sliding_window")) and f.get("sliding_window") is not None
    return [on and i in nope for i in range(n_layer)]


def no_nope_layers(f: ConfigFields, n_layer: int) -> list[int]:
    return []


def smollm3_nope_layers(f: ConfigFields, n_layer: int) -> list[int]:
    """SmolLM3's layers without rope: no_rope_layers[i] == 0 (every no_rope_layer_interval-th by default)."""
    flags = f.raw.get("no_rope_layers")
    if flags is None:
        every = f.int("no_rope_layer_interval")
        flags = [int((i + 1) % every != 0) for i in range(n_layer)]
    if not (isinstance(flags, list) and len(flags) == n_layer and all(v in (0, 1) for v in flags)):
        f.refuse("no_rope_layers", flags, f"a list of {n_layer} flags 0 or 1")
    return [i for i, v in enumerate(flags) if not v]


def no_scales(f: ConfigFields) -> dict:
    return {}


def _gemma_scales(f: ConfigFields, attn_softcap: bool) -> dict:
    """Gemma 2 / 3: query_pre_attn_scalar ** -0.5, the final soft-cap, and (Gemma 2 only) the attention's."""
    out = {"attn_scale": f.number("query_pre_attn_scalar") ** -0.5}
    if f.get("final_logit_softcapping") is not None:
        out["final_softcap"] = f.number("final_logit_softcapping")
    if attn_softcap and f.get("attn_logit_softcapping") is not None:
        out["attn_softcap"] = f.number("attn_logit_softcapping")
    elif f.get("attn_logit_softcapping") is not None:
        f.notes.append(f"{f.where}: attn_logit_softcapping is ignored, as transformers' gemma3_text ignores it "
                       "(its attention does not soft-cap)")
    if f.get("use_bidirectional_attention"):
        f.unsupported("use_bidirectional_attention (an embedding model, not a decoder)")
    return out


def gemma2_scales(f: ConfigFields) -> dict:
    return _gemma_scales(f, attn_softcap=True)


def gemma3_scales(f: ConfigFields) -> dict:
    return _gemma_scales(f, attn_softcap=False)


def granite_scales(f: ConfigFields) -> dict:
    """Granite's multipliers and logits divisor, as config.json gives them."""
    return dict(embed_scale=f.number("embedding_multiplier"), attn_scale=f.number("attention_multiplier"),
                residual_scale=f.number("residual_multiplier"), logits_divisor=f.number("logits_scaling"))


# --- the record ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    """How one model_type differs from Llama: its defaults, layout, norms, rope and activation reading, rules."""
    model_type: str
    defaults: dict               # transformers' config class defaults for the keys the converter reads
    layout: Layout = LLAMA_LAYOUT
    norm_layout: str = "pre"     # pre | sandwich | post (DecoderConfig.norm_layout; hf_layout.NORM_NAMES)
    qk_norm: str | None = None   # None | head | proj (DecoderConfig.qk_norm)
    gain_plus_one: bool = False  # RMSNorm gains stored as w and applied as 1 + w (Gemma): we store 1 + w
    fused: bool = False          # qkv_proj and gate_up_proj, split here (Phi-3)
    act_key: str = "hidden_act"
    act_aliases: dict = field(default_factory=dict)   # legacy activation names the config class reads otherwise
    scaled_embedding: bool = False   # embeddings times sqrt(hidden_size) (Gemma)
    partial_rope: bool = False   # transformers honours partial_rotary_factor with default rope (Phi-3 only)
    rope_aliases: dict = field(default_factory=dict)  # legacy names of a rope type
    rope_per_layer_type: bool = False   # rope settings per layer type, the sliding layers' own base (Gemma 3)
    biases: Callable[[ConfigFields], dict] = attention_bias
    sliding: Callable[[ConfigFields, int, list[int]], list[bool]] = no_sliding   # when config.json has no layer_types
    nope_layers: Callable[[ConfigFields, int], list[int]] = no_nope_layers
    scales: Callable[[ConfigFields], dict] = no_scales     # constant factors besides Gemma's sqrt(d) embedding scale


RECORDS = (
    Family("gpt2", layout=GPT2_LAYOUT,
           defaults=dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                         activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
                         scale_attn_by_inverse_layer_idx=False, add_cross_attention=False,
                         tie_word_embeddings=True)),
    Family("llama", biases=attention_and_mlp_bias,
           defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                         max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_theta=10000.0, attention_bias=False, mlp_bias=False)),
    Family("mistral", biases=no_bias, sliding=sliding_everywhere,
           defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                         max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_theta=10000.0, sliding_window=4096)),
    Family("qwen2", biases=qkv_bias_only, sliding=sliding_past_max_window_layers,
           defaults=dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, hidden_act="silu",
                         max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_theta=10000.0, use_sliding_window=False, sliding_window=4096, max_window_layers=28)),
    Family("qwen3", qk_norm="head", sliding=sliding_past_max_window_layers,
           defaults=dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                         max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_theta=10000.0, attention_bias=False, use_sliding_window=False, sliding_window=4096,
                         max_window_layers=28)),
    # GemmaConfig: the legacy hidden_act "gelu" of the releases means the tanh approximation
    Family("gemma", gain_plus_one=True, scaled_embedding=True, act_aliases={"gelu": "gelu_new"},
           defaults=dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=16, head_dim=256,
                         hidden_act="gelu_pytorch_tanh", max_position_embeddings=8192, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, rope_theta=10000.0, attention_bias=False)),
    Family("gemma2", norm_layout="sandwich", gain_plus_one=True, act_key="hidden_activation", scaled_embedding=True,
           sliding=sliding_alternate, scales=gemma2_scales,
           defaults=dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                         hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, rope_theta=10000.0, attention_bias=False,
                         query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                         attn_logit_softcapping=50.0)),
    Family("gemma3_text", norm_layout="sandwich", qk_norm="head", gain_plus_one=True, act_key="hidden_activation",
           scaled_embedding=True, rope_per_layer_type=True, sliding=sliding_but_every_pattern_th,
           scales=gemma3_scales,
           defaults=dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                         hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                         attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                         final_logit_softcapping=None, attn_logit_softcapping=None,
                         use_bidirectional_attention=False)),
    # Phi3Config's legacy names of longrope: su, yarn
    Family("phi3", fused=True, partial_rope=True, rope_aliases={"su": "longrope", "yarn": "longrope"}, biases=no_bias,
           sliding=sliding_everywhere,
           defaults=dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
                         max_position_embeddings=4096, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None)),
    Family("olmo2", norm_layout="post", qk_norm="proj",
           defaults=dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
                         max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_theta=10000.0, attention_bias=False)),
    Family("smollm3", biases=attention_and_mlp_bias, sliding=sliding_nope_layers, nope_layers=smollm3_nope_layers,
           defaults=dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=4, hidden_act="silu",
                         max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_theta=2_000_000.0, use_sliding_window=False, sliding_window=None,
                         no_rope_layer_interval=4, attention_bias=False, mlp_bias=False)),
    Family("granite", biases=attention_and_mlp_bias, scales=granite_scales,
           defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
                         max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_theta=10000.0, attention_bias=False, mlp_bias=False, embedding_multiplier=1.0,
                         logits_scaling=1.0, residual_multiplier=1.0, attention_multiplier=1.0)),
)


def registry(records: tuple[Family, ...]) -> dict[str, Family]:
    """model_type -> its record; two records of one model_type are a bug, refused at import."""
    out: dict[str, Family] = {}
    for family in records:
        if family.model_type in out:
            raise ValueError(f"models/families.py: two records of model_type {family.model_type!r}; keep one")
        out[family.model_type] = family
    return out


FAMILIES = registry(RECORDS)
SUPPORTED = tuple(FAMILIES)
HF_DEFAULTS = {model_type: family.defaults for model_type, family in FAMILIES.items()}

# model types people pass by mistake, and what to do instead (said in the refusal)
UNSUPPORTED_WHY = {
    "gemma3": "the multimodal Gemma 3; its text decoder alone is supported: a folder whose config.json has model_type "
              "gemma3_text (as the 1B Gemma 3 checkpoints ship), the text_config and the language model's weights",
}


def family_of(kind: object, where) -> Family:
    """The record of model_type `kind`; refused in one line otherwise, saying why where we know (UNSUPPORTED_WHY,
    MoE), and listing SUPPORTED."""
    if isinstance(kind, str) and kind in FAMILIES:
        return FAMILIES[kind]
    why = None
    if isinstance(kind, str):       # (any JSON value may stand here: a list is not a dict key)
        why = UNSUPPORTED_WHY.get(kind) or ("a mixture-of-experts model; the converter takes dense decoders only"
                                            if "moe" in kind or kind == "mixtral" else None)
    raise ConvertError(f"{where}: model_type {kind!r} is not supported{f' ({why})' if why else ''}; "
                       f"supported: {', '.join(SUPPORTED)}")
