"""A Hugging Face config.json read key by key, the way transformers' config classes read it.

`ConfigFields` gives each key with the family's transformers defaults (models/families.py) and
refuses a bad value in one line naming the key; the KV-cache capacity rule (`kv_capacity`)
and the mapping back from a converted DecoderConfig field to the config.json key it came from
(`converted_field_error`, so that DecoderConfig.validate's refusal names the user's field) live
here too. The family's rules that read the fields are in models/families.py; rope in
models/hf_rope.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from models.decoder import MAX_LAYERS
from models.hf_files import ConvertError

if TYPE_CHECKING:
    from models.families import Family

DEFAULT_CAPACITY = 2048   # KV-cache capacity when --max-seq-len is not given (and the model allows more)
# HF activation names -> the decoder's (gelu_pytorch_tanh is gelu_new, computed the same way)
HF_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu",
                  "silu": "silu", "swish": "silu"}

LAYER_TYPES = ("full_attention", "sliding_attention")     # transformers' layer_types values
MISSING = object()   # a key a config.json leaves out (distinct from a null value)


class ConfigFields:
    """Reads config keys with transformers' defaults (the family's record); names the key in every refusal."""

    def __init__(self, where: Path, raw: dict, family: Family):
        self.where, self.raw, self.kind, self.family = where, raw, raw["model_type"], family
        self.defaults = family.defaults
        self.notes: list[str] = []      # what the user should hear about a choice made for them

    def get(self, key: str, default=None):
        return self.raw[key] if key in self.raw else self.defaults.get(key, default)

    def int(self, key: str, allow_none: bool = False):
        v = self.get(key)
        if v is None and allow_none:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            self.refuse(key, v, "a positive integer")
        return v

    def layers(self, key: str) -> int:
        """A layer count, bounded before anything is listed per layer (a corrupt 2**40 is one line, not an OOM)."""
        v = self.int(key)
        if v > MAX_LAYERS:
            self.refuse(key, v, f"at most {MAX_LAYERS:,} layers")
        return v

    def number(self, key: str, *value) -> float:
        """A positive number: the config key's, or the value given (read from under it, MISSING if absent)."""
        v = value[0] if value else self.get(key)
        if v is MISSING or isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v:
            self.refuse(key, v, "a positive number")
        return float(v)

    def refuse(self, key: str, value, expected: str):
        found = "missing" if value is MISSING else repr(value)
        raise ConvertError(f"{self.where}: {self.kind} field {key!r} is {found}; expected {expected}")

    def unsupported(self, what: str):
        raise ConvertError(f"{self.where}: {what} is not supported by the converter ({self.kind}); "
                           "the decoder cannot express it")

    def activation(self, key: str) -> str:
        act = self.get(key)
        if not isinstance(act, str) or act not in HF_ACTIVATIONS:
            self.unsupported(f"{key} {act!r} (supported: {', '.join(HF_ACTIVATIONS)})")
        return HF_ACTIVATIONS[act]


# The smallest KV-cache capacity a converted model may have: export.build verifies a graph on a prefill and 3
# decode steps (export/conventions.session_steps), 4 positions; a smaller cache crashed that check in ONNX Runtime.
MIN_CAPACITY = 4


def kv_capacity(f: ConfigFields, key: str, max_seq_len: int | None) -> int:
    """min(config.json's `key`, --max-seq-len or DEFAULT_CAPACITY); refused below MIN_CAPACITY, naming its source."""
    capacity = min(f.int(key), max_seq_len or DEFAULT_CAPACITY)
    if capacity < MIN_CAPACITY:
        given = f"--max-seq-len {max_seq_len}" if max_seq_len is not None and max_seq_len < f.int(key) else \
            f"{f.where}: {key} {f.int(key)}"
        raise ConvertError(f"{given}: expected a KV-cache capacity of at least {MIN_CAPACITY} (a prompt and 3 decode "
                           f"steps, what export.build verifies), found {capacity}; "
                           + (f"pass --max-seq-len {MIN_CAPACITY} or more" if given.startswith("--") else
                              f"this model cannot hold a prompt and a reply (fix {key} in config.json)"))
    return capacity


# Where each converted DecoderConfig field comes from in a Hugging Face config.json, so that a refusal of
# the converted config (DecoderConfig.validate) names the user's field, not ours: the first candidate
# config.json holds (dotted: a key inside an object), else the first the model type defaults.
HF_CONFIG_FIELDS = {
    "vocab_size": ("vocab_size",),
    "d_model": ("hidden_size", "n_embd"),
    "n_layer": ("num_hidden_layers", "n_layer"),
    "n_head": ("num_attention_heads", "n_head"),
    "n_kv_head": ("num_key_value_heads",),
    "head_size": ("head_dim",),
    "max_seq_len": ("max_position_embeddings", "n_positions"),
    "mlp_hidden": ("intermediate_size", "n_inner"),
    "eps": ("rms_norm_eps", "layer_norm_epsilon"),
    "sliding_window": ("sliding_window",),
    "rotary_dim": ("partial_rotary_factor", "rope_parameters.partial_rotary_factor"),
    "rope_theta": ("rope_scaling.rope_theta", "rope_parameters.full_attention.rope_theta",
                   "rope_parameters.rope_theta", "rope_theta"),
    "local_rope_theta": ("rope_parameters.sliding_attention.rope_theta", "rope_local_base_freq"),
    "attn_scale": ("query_pre_attn_scalar", "attention_multiplier"),      # Gemma: its ** -0.5; Granite: as is
    "attn_softcap": ("attn_logit_softcapping",),
    "final_softcap": ("final_logit_softcapping",),
    "embed_scale": ("embedding_multiplier", "hidden_size"),               # Granite's; Gemma: sqrt(hidden_size)
    "residual_scale": ("residual_multiplier",),
    "logits_divisor": ("logits_scaling",),
}


def _hf_field(f: ConfigFields, ours: str) -> tuple[str, object] | None:
    """(config.json key, its value) that the converted field `ours` came from, or None."""
    candidates = HF_CONFIG_FIELDS.get(ours, ())
    for key in candidates:
        v = f.raw
        for part in key.split("."):
            v = v.get(part, MISSING) if isinstance(v, dict) else MISSING
        if v is not MISSING:
            return key, v
    return next(((key, f.defaults[key]) for key in candidates if key in f.defaults), None)


def converted_field_error(f: ConfigFields, problem: str) -> ConvertError:
    """DecoderConfig.validate's `<field> = <value>; expected <what>` as the user's config.json field."""
    ours, _, rest = problem.partition(" = ")
    found, _, expected = rest.partition("; expected ")
    source = _hf_field(f, ours)
    if source is None or not expected:
        return ConvertError(f"{f.where}: converted config field {problem}")
    key, value = source
    expected = expected.replace("a positive number", "a finite positive number")
    if repr(value) == found:
        return ConvertError(f"{f.where}: {f.kind} field {key!r} is {found}; expected {expected}; "
                            f"correct {key} in config.json")
    return ConvertError(f"{f.where}: {f.kind} field {key!r} is {value!r}, which gives the decoder's {ours} = {found}; "
                        f"expected {ours} {expected}; correct {key} in config.json")
