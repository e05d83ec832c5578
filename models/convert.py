"""Hugging Face model folders -> our checkpoint: config, weights and tokenizer.

    python -m models.convert HF_DIR --out CKPT [--max-seq-len N]

HF_DIR is a folder as `save_pretrained` writes it: config.json (model_type one of
SUPPORTED), the weights as model.safetensors, sharded safetensors with
model.safetensors.index.json, or pytorch_model.bin (sharded with
pytorch_model.bin.index.json), and tokenizer.json when the model has a fast
tokenizer. CKPT is a checkpoint (models/checkpoint.py, format 2) that export.build,
runtime.generate --backend torch and train.finetune read; `export.build
--checkpoint HF_DIR` converts in memory with the same code.

    gpt2     LayerNorm, learned positions, Conv1D weights ([in, out], transposed here;
             c_attn split into q/k/v), gelu_new, tied head. LN-free GPT-2 (FakeLN, eps
             1e12) is an ordinary gpt2 folder: its norms keep their eps.
    llama    RMSNorm, rotary positions (default / linear / llama3 / yarn / longrope scaling),
    mistral  grouped-query attention, SwiGLU MLP, optional q/k/v/o and MLP biases (llama),
    qwen2    untied or tied head; qwen2 has q/k/v biases; sliding windows (mistral, qwen2's
             use_sliding_window) shorter than the capacity are the attention's mask.
    qwen3    per-head q_norm / k_norm before rope; yarn for long context
    gemma    (1 + w) RMSNorm gains (stored as 1 + w), embeddings x sqrt(d), GeGLU; gemma2 adds
    gemma2   post-attention / post-MLP norms (sandwich), query_pre_attn_scalar, attention and
    gemma3_text  final soft-caps, alternating sliding layers; gemma3_text adds q_norm / k_norm,
             5 local : 1 global layers and the local layers' own rope base (kept when their
             window covers the cache and is dropped: local_rope_layers)
    phi3     fused qkv_proj / gate_up_proj (split by rows), partial_rotary_factor, longrope
    olmo2    post-norms only, q_norm / k_norm over the whole projection
    smollm3  NoPE layers (no_rope_layers)
    granite  embedding / attention / residual multipliers, logits / logits_scaling

config.json and the weights mean what they mean to the installed transformers (5.x),
whose forward the tests compare against: the rope settings are rope_scaling when it is
non-empty, else rope_parameters (top-level rope_theta fills in); partial_rotary_factor
is ignored with default rope, as transformers' llama family ignores it; a tied config's
stored lm_head.weight that differs from the embedding is kept (untied), and a missing
embedding is the stored head. Names, shapes and the family are checked from the files'
headers before the memory estimate; a pytorch_model.bin is read weights-only (a pickle
that would call code is refused).

The KV-cache capacity (max_seq_len) is min(max_position_embeddings, --max-seq-len,
default DEFAULT_CAPACITY): a cache is preallocated at full capacity. Everything
else that the decoder cannot express (another model_type, rope scaling type,
activation, cross-attention, tensors with no place in the layout) is refused with one
line naming it.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import errno
import json
import os
import pickle
import re
import sys
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from core.errors import first_line
from models.checkpoint import CONFIG, TOKENIZER, CheckpointError, all_finite, check_tokenizer_fits
from models.decoder import MAX_LAYERS, Decoder, DecoderConfig
from models.rope import ROPE_NEEDS, YARN_OPTIONAL

SUPPORTED = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3",
             "granite")
# model types people pass by mistake, and what to do instead (said in the refusal)
UNSUPPORTED_WHY = {
    "gemma3": "the multimodal Gemma 3; its text decoder alone is supported: a folder whose config.json has model_type "
              "gemma3_text (as the 1B Gemma 3 checkpoints ship), the text_config and the language model's weights",
}
DEFAULT_CAPACITY = 2048   # KV-cache capacity when --max-seq-len is not given (and the model allows more)
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_BIN, TORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
WEIGHT_FILES = f"{SAFETENSORS}, {SAFETENSORS_INDEX} with its shards, {TORCH_BIN} or {TORCH_BIN_INDEX} with its shards"

# The defaults of transformers' config classes for the keys read here (a saved config.json
# may leave a default out); tests/models/test_convert.py checks them against transformers.
HF_DEFAULTS: dict[str, dict] = {
    "gpt2": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                 activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
                 scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True),
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                  attention_bias=False, mlp_bias=False),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                    max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    rope_theta=10000.0, sliding_window=4096),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                  max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                  attention_bias=False, use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    "gemma": dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=16, head_dim=256, hidden_act="gelu_pytorch_tanh",
                  max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0,
                  attention_bias=False),
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0,
                   attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
                        tie_word_embeddings=True, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                        attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                        final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False),
    "phi3": dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=4096,
                 original_max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 rope_theta=10000.0, sliding_window=None),
    "olmo2": dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0, attention_bias=False),
    "smollm3": dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                    num_attention_heads=16, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=2_000_000.0, use_sliding_window=False,
                    sliding_window=None, no_rope_layer_interval=4, attention_bias=False, mlp_bias=False),
    "granite": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0, attention_bias=False,
                    mlp_bias=False, embedding_multiplier=1.0, logits_scaling=1.0, residual_multiplier=1.0,
                    attention_multiplier=1.0),
}


@dataclass(frozen=True)
class Family:
    """How a Llama-like model type differs from Llama: its norms, its weights' layout, its activation key."""
    norm_layout: str = "pre"     # pre | sandwich | post (DecoderConfig.norm_layout)
    qk_norm: str | None = None   # None | head | proj (DecoderConfig.qk_norm)
    gain_plus_one: bool = False  # RMSNorm gains stored as w and applied as 1 + w (Gemma): we store 1 + w
    fused: bool = False          # qkv_proj and gate_up_proj, split here (Phi-3)
    act_key: str = "hidden_act"
    scaled_embedding: bool = False   # embeddings times sqrt(hidden_size) (Gemma)
    partial_rope: bool = False   # transformers honours partial_rotary_factor with default rope (Phi-3 only)


FAMILIES = {"llama": Family(), "mistral": Family(), "qwen2": Family(), "qwen3": Family(qk_norm="head"),
            "gemma": Family(gain_plus_one=True, scaled_embedding=True),
            "gemma2": Family("sandwich", gain_plus_one=True, act_key="hidden_activation", scaled_embedding=True),
            "gemma3_text": Family("sandwich", "head", gain_plus_one=True, act_key="hidden_activation",
                                  scaled_embedding=True),
            "phi3": Family(fused=True, partial_rope=True), "olmo2": Family("post", "proj"), "smollm3": Family(),
            "granite": Family()}
# HF activation names -> the decoder's (gelu_pytorch_tanh is gelu_new, computed the same way)
HF_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu",
                  "silu": "silu", "swish": "silu"}
# buffers some saved models carry that are not weights (causal masks, rotary tables)
IGNORED = re.compile(r".*(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")


MISSING = object()   # a key a config.json leaves out (distinct from a null value)


class ConvertError(CheckpointError):
    """A Hugging Face folder that cannot be converted; one line naming the file and what is wrong."""


# --- config -----------------------------------------------------------------------------------

def read_hf_config(path: Path) -> dict:
    """config.json of an HF folder with its model type checked; ConvertError otherwise."""
    where = Path(path) / CONFIG
    if not Path(path).is_dir():
        raise ConvertError(f"{path}: expected a Hugging Face model folder (config.json and weights), found "
                           f"{'a file' if Path(path).exists() else 'nothing'}")
    try:
        raw = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConvertError(f"{where}: missing; a Hugging Face model folder has config.json beside its weights") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConvertError(f"{where}: expected a readable JSON file, found {first_line(e)}; re-save the folder") from None
    if not isinstance(raw, dict):
        raise ConvertError(f"{where}: expected a JSON object, found {type(raw).__name__}")
    if "format" in raw and "norm" in raw:       # models/checkpoint.py's config.json, not a Hugging Face one
        raise ConvertError(f"{where}: expected a Hugging Face config.json, found one of our checkpoints "
                           f"(format {raw['format']!r}, norm {raw['norm']!r}); this is already a checkpoint: "
                           f"use it directly (export.build --checkpoint {path})")
    _require_supported(raw.get("model_type"), where)
    return raw


def _require_supported(kind: object, where: str) -> None:
    """Refuse a model_type outside SUPPORTED in one line, saying why where we know (UNSUPPORTED_WHY, MoE)."""
    if kind in SUPPORTED:
        return
    why = None
    if isinstance(kind, str):       # (any JSON value may stand here: a list is not a dict key)
        why = UNSUPPORTED_WHY.get(kind) or ("a mixture-of-experts model; the converter takes dense decoders only"
                                            if "moe" in kind or kind == "mixtral" else None)
    raise ConvertError(f"{where}: model_type {kind!r} is not supported{f' ({why})' if why else ''}; "
                       f"supported: {', '.join(SUPPORTED)}")


def is_hf_folder(path: str | os.PathLike) -> bool:
    """A folder whose config.json names a model_type and is not one of our checkpoints."""
    try:
        raw = json.loads((Path(path) / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(raw, dict) and "model_type" in raw and "format" not in raw


class _Fields:
    """Reads config keys with transformers' defaults; names the key in every refusal."""

    def __init__(self, where: Path, raw: dict):
        self.where, self.raw, self.kind = where, raw, raw["model_type"]
        self.defaults = HF_DEFAULTS[self.kind]
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


def _capacity(f: _Fields, key: str, max_seq_len: int | None) -> int:
    capacity = min(f.int(key), max_seq_len or DEFAULT_CAPACITY)
    if capacity < MIN_CAPACITY:
        given = f"--max-seq-len {max_seq_len}" if max_seq_len is not None and max_seq_len < f.int(key) else \
            f"{f.where}: {key} {f.int(key)}"
        raise ConvertError(f"{given}: expected a KV-cache capacity of at least {MIN_CAPACITY} (a prompt and 3 decode "
                           f"steps, what export.build verifies), found {capacity}; "
                           + (f"pass --max-seq-len {MIN_CAPACITY} or more" if given.startswith("--") else
                              f"this model cannot hold a prompt and a reply (fix {key} in config.json)"))
    return capacity


LAYER_TYPES = ("full_attention", "sliding_attention")


def _rope_settings(f: _Fields) -> tuple[str, dict]:
    """The rope settings as the installed transformers reads them, and the key they came from.

    PreTrainedConfig.convert_rope_params_to_dict / standardize_rope_params (transformers 5): a
    non-empty rope_scaling replaces rope_parameters whole (its rope_theta too); rope_theta and
    partial_rotary_factor at the top level fill what the dict leaves out; rope_type defaults to
    the legacy 'type', then 'default'; a scaled rope's original length is the top-level
    original_max_position_embeddings (Phi-3 keeps it there) or max_position_embeddings. Per layer
    type (nested dicts): Gemma 3's own reading (_gemma3_rope); refused elsewhere (those families' rotary
    embeddings read one set).
    """
    scaling, params = f.raw.get("rope_scaling"), f.raw.get("rope_parameters")
    key, chosen = ("rope_scaling", scaling) if scaling else ("rope_parameters", params)
    chosen = {} if chosen is None else chosen
    if not isinstance(chosen, dict):
        f.refuse(key, chosen, "an object")
    if any(isinstance(v, dict) for v in chosen.values()):     # transformers' per-layer-type form (nested dicts)
        f.unsupported(f"{key} per layer type")
    if scaling and params and params != scaling:
        f.notes.append(f"{f.where} has both rope_scaling and rope_parameters: rope_scaling is used and "
                       "rope_parameters ignored, as transformers does (keep one of them)")
    return key, _standardized(f, chosen, f.get("rope_theta"))


def _standardized(f: _Fields, chosen: dict, theta) -> dict:
    p = dict(chosen)
    p.setdefault("rope_theta", theta)
    if f.raw.get("partial_rotary_factor") is not None:
        p.setdefault("partial_rotary_factor", f.raw["partial_rotary_factor"])
    p.setdefault("rope_type", p.get("type", "default"))
    if f.kind == "phi3" and p["rope_type"] in ("su", "yarn"):      # Phi3Config's legacy names of longrope
        p["rope_type"] = "longrope"
    if p["rope_type"] in ("llama3", "yarn", "longrope"):
        if f.raw.get("original_max_position_embeddings") is not None:
            p["original_max_position_embeddings"] = f.raw["original_max_position_embeddings"]
        else:
            p.setdefault("original_max_position_embeddings", f.get("max_position_embeddings"))
    if p["rope_type"] in ("yarn", "longrope") and p.get("factor") is None:   # transformers' own default factor
        p["factor"] = f.get("max_position_embeddings") / p["original_max_position_embeddings"]
    return p


def _gemma3_rope(f: _Fields) -> tuple[str, dict, dict]:
    """Gemma3TextConfig.convert_rope_params_to_dict: the global layers' settings (rope_parameters
    full_attention, a flat rope_scaling updating it, rope_theta) and the sliding layers' (rope_parameters
    sliding_attention, rope_local_base_freq)."""
    scaling, params = f.raw.get("rope_scaling"), f.raw.get("rope_parameters")
    key = "rope_parameters"
    if params is not None and not (isinstance(params, dict) and all(v is None or isinstance(v, dict)
                                                                    for v in params.values())):
        f.refuse(key, params, "an object of one settings object per layer type")
    # a layer type it does not set starts as {"rope_type": "default"}, before rope_scaling updates it: so a
    # rope_scaling with only the legacy "type" key stays default rope there (transformers 5.x reads it so)
    params = {t: {"rope_type": "default"} if (params or {}).get(t) is None else dict(params[t]) for t in LAYER_TYPES}
    if scaling:
        if not isinstance(scaling, dict):
            f.refuse("rope_scaling", scaling, "an object")
        params["full_attention"].update(scaling)
        if params["full_attention"]["rope_type"] == "default" and scaling.get("type") not in (None, "default"):
            f.notes.append(f"{f.where}: rope_scaling type {scaling['type']!r} is ignored, as transformers' gemma3_text "
                           "ignores it (the global layers' rope_type stays 'default'; write rope_type to mean it)")
    full = _standardized(f, params["full_attention"], f.get("rope_theta"))
    local = _standardized(f, params["sliding_attention"], f.get("rope_local_base_freq"))
    return key, full, local


def _rope_fields(f: _Fields, key: str, params: dict) -> tuple[float, dict | None]:
    """rope_theta and rope_scaling of one rope; refuses what the decoder cannot compute."""
    kind = params["rope_type"]
    theta = f.number("rope_theta", params["rope_theta"])
    if not isinstance(kind, str) or kind not in ROPE_NEEDS:
        f.unsupported(f"rope type {kind!r} (supported: {', '.join(ROPE_NEEDS)}) from {key}")
    for k in ROPE_NEEDS[kind]:
        if k.endswith("_factor") and kind == "longrope":
            v = params.get(k, MISSING)
            if not (isinstance(v, list) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                      and x > 0 for x in v)):
                f.refuse(f"{key}.{k}", v, "a list of positive numbers")
        else:
            f.number(f"{key}.{k}", params.get(k, MISSING))
    if kind == "default":
        return theta, None
    keep = ROPE_NEEDS[kind] + (("factor", "attention_factor") if kind == "longrope" else ()) + \
        (YARN_OPTIONAL if kind == "yarn" else ())
    return theta, {"rope_type": kind, **{k: params[k] for k in keep if params.get(k) is not None}}


def _rope(f: _Fields, head_dim: int, local_layers: list[int], capacity: int) -> dict:
    """The decoder's rope fields (theta, scaling, rotary_dim; the base of the layers whose layer type is
    sliding_attention, local_layers, whether or not their window survives as a mask)."""
    family = FAMILIES[f.kind]
    local = None
    if f.kind == "gemma3_text":
        key, params, local = _gemma3_rope(f)
    else:
        key, params = _rope_settings(f)
    theta, scaling = _rope_fields(f, key, params)
    partial = params.get("partial_rotary_factor", 1.0)
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        f.refuse("partial_rotary_factor", partial, "a number in (0, 1]")
    rotary_dim = None
    if family.partial_rope:         # Phi-3 rotates the first int(head_dim * factor) dims, whatever the rope type
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or rotary_dim == 0:
            f.refuse("partial_rotary_factor", partial, f"a factor giving an even, non-zero part of head_dim {head_dim}")
        rotary_dim = None if rotary_dim == head_dim else rotary_dim
    elif partial != 1.0 and scaling is not None:
        # transformers' llama-like families rotate the whole head: their default rope ignores
        # partial_rotary_factor, and a scaled rope with it fails there (cos/sin narrower than the head)
        f.unsupported(f"partial_rotary_factor {partial!r} with rope type {scaling['rope_type']!r} from {key} "
                      "(transformers cannot run it either)")
    elif partial != 1.0:
        f.notes.append(f"{f.where}: partial_rotary_factor {partial!r} is ignored, as transformers' {f.kind} "
                       "ignores it (its rotary embedding covers the whole head)")
    if scaling is not None and scaling["rope_type"] == "longrope":
        half = (rotary_dim or head_dim) // 2
        for k in ("short_factor", "long_factor"):
            if len(scaling[k]) != half:
                f.refuse(f"{key}.{k}", f"{len(scaling[k])} numbers", f"{half} (half the rotated dims)")
    if scaling is not None and scaling["rope_type"] == "longrope" and \
            capacity > scaling["original_max_position_embeddings"]:
        f.notes.append(f"{f.where}: longrope switches to its long factors past position "
                       f"{scaling['original_max_position_embeddings']}; transformers' generate then recomputes the "
                       "whole cache once, this runtime's KV cache keeps the keys written before (tokens after "
                       "that position may differ from transformers'; --max-seq-len "
                       f"{scaling['original_max_position_embeddings']} avoids the switch)")
    out = dict(pos_embedding="rope", rope_theta=theta, rope_scaling=scaling, rotary_dim=rotary_dim)
    if local is not None and local_layers:
        local_theta, local_scaling = _rope_fields(f, "rope_parameters.sliding_attention", local)
        if local_scaling is not None:
            f.unsupported(f"rope type {local_scaling['rope_type']!r} on the sliding layers")
        if local_theta != theta or scaling is not None:
            out.update(local_rope_theta=local_theta, local_rope_layers=list(local_layers))
    return out


def gpt2_config(f: _Fields, max_seq_len: int | None) -> DecoderConfig:
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
                         max_seq_len=_capacity(f, "n_positions", max_seq_len), mlp="gelu", norm="layernorm",
                         tie_embeddings=bool(f.get("tie_word_embeddings")), eps=eps,
                         mlp_hidden=f.int("n_inner", allow_none=True), activation=f.activation("activation_function"),
                         pos_embedding="learned", qkv_bias=True, out_bias=True, mlp_bias=True)


def _biases(f: _Fields) -> dict:
    if f.kind == "qwen2":
        return dict(qkv_bias=True, out_bias=False, mlp_bias=False)
    if f.kind in ("mistral", "phi3"):
        return dict(qkv_bias=False, out_bias=False, mlp_bias=False)
    attn = bool(f.get("attention_bias"))
    return dict(qkv_bias=attn, out_bias=attn, mlp_bias=bool(f.get("mlp_bias")) if f.kind in ("llama", "granite",
                                                                                           "smollm3") else False)


def _layer_types(f: _Fields, n_layer: int, nope: list[int]) -> list[str]:
    """Each layer's attention kind, as the family's config class derives it when config.json has no layer_types."""
    raw = f.raw.get("layer_types")
    if raw is not None:
        if not (isinstance(raw, list) and len(raw) == n_layer and all(t in LAYER_TYPES for t in raw)):
            f.refuse("layer_types", raw, f"a list of {n_layer} of {', '.join(LAYER_TYPES)}")
        return list(raw)
    window = f.get("sliding_window")
    if f.kind in ("qwen2", "qwen3"):
        on = bool(f.get("use_sliding_window")) and window is not None
        first = f.get("max_window_layers")     # 0: every layer slides (transformers takes it)
        if on and (isinstance(first, bool) or not isinstance(first, int) or first < 0):
            f.refuse("max_window_layers", first, "a non-negative integer")
        sliding = [on and i >= first for i in range(n_layer)]
    elif f.kind == "gemma2":
        sliding = [bool((i + 1) % 2) for i in range(n_layer)]
    elif f.kind == "gemma3_text":
        pattern = f.int("sliding_window_pattern") if "sliding_window_pattern" in f.raw else 6
        sliding = [bool((i + 1) % pattern) for i in range(n_layer)]
    elif f.kind == "smollm3":
        sliding = [bool(f.get("use_sliding_window")) and window is not None and i in nope for i in range(n_layer)]
    elif f.kind in ("mistral", "phi3"):
        sliding = [window is not None] * n_layer
    else:
        sliding = [False] * n_layer
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _nope_layers(f: _Fields, n_layer: int) -> list[int]:
    """SmolLM3's layers without rope: no_rope_layers[i] == 0 (every no_rope_layer_interval-th by default)."""
    if f.kind != "smollm3":
        return []
    flags = f.raw.get("no_rope_layers")
    if flags is None:
        every = f.int("no_rope_layer_interval")
        flags = [int((i + 1) % every != 0) for i in range(n_layer)]
    if not (isinstance(flags, list) and len(flags) == n_layer and all(v in (0, 1) for v in flags)):
        f.refuse("no_rope_layers", flags, f"a list of {n_layer} flags 0 or 1")
    return [i for i, v in enumerate(flags) if not v]


def _scales(f: _Fields, d: int) -> dict:
    """Gemma's and Granite's constant factors (DecoderConfig's embed_scale, attn_scale, ...)."""
    out = {}
    if FAMILIES[f.kind].scaled_embedding:
        out["embed_scale"] = d ** 0.5
    if f.kind in ("gemma2", "gemma3_text"):
        out["attn_scale"] = f.number("query_pre_attn_scalar") ** -0.5
        if f.get("final_logit_softcapping") is not None:
            out["final_softcap"] = f.number("final_logit_softcapping")
        if f.kind == "gemma2" and f.get("attn_logit_softcapping") is not None:
            out["attn_softcap"] = f.number("attn_logit_softcapping")
        elif f.get("attn_logit_softcapping") is not None:
            f.notes.append(f"{f.where}: attn_logit_softcapping is ignored, as transformers' gemma3_text ignores it "
                           "(its attention does not soft-cap)")
        if f.get("use_bidirectional_attention"):
            f.unsupported("use_bidirectional_attention (an embedding model, not a decoder)")
    if f.kind == "granite":
        out.update(embed_scale=f.number("embedding_multiplier"), attn_scale=f.number("attention_multiplier"),
                   residual_scale=f.number("residual_multiplier"), logits_divisor=f.number("logits_scaling"))
    return out


def llama_config(f: _Fields, max_seq_len: int | None) -> DecoderConfig:
    """Every family but GPT-2: Llama's layout with what FAMILIES and the family's fields add."""
    family = FAMILIES[f.kind]
    d, heads, n_layer = f.int("hidden_size"), f.int("num_attention_heads"), f.layers("num_hidden_layers")
    kv = f.int("num_key_value_heads", allow_none=True) or heads
    head_dim = f.int("head_dim", allow_none=True) or d // heads
    if f.get("head_dim") is None and d % heads:
        f.refuse("num_attention_heads", heads, f"a divisor of hidden_size ({d})")
    if heads % kv:
        f.refuse("num_key_value_heads", kv, f"a divisor of num_attention_heads ({heads})")
    eps = f.number("rms_norm_eps")
    capacity = _capacity(f, "max_position_embeddings", max_seq_len)
    nope = _nope_layers(f, n_layer)
    local = [i for i, t in enumerate(_layer_types(f, n_layer, nope)) if t == "sliding_attention"]
    window = f.int("sliding_window") if local else None
    # a window that covers the whole cache is plain causal attention: no mask; the layers stay local
    # for their rope base (Gemma 3's rope_local_base_freq), which does not depend on the mask
    sliding = [] if window is None or window >= capacity else local
    window = window if sliding else None
    # GemmaConfig: the legacy hidden_act "gelu" of the releases means the tanh approximation
    legacy_gelu = f.kind == "gemma" and f.get(family.act_key) == "gelu"
    activation = "gelu_new" if legacy_gelu else f.activation(family.act_key)
    return DecoderConfig(vocab_size=f.int("vocab_size"), d_model=d, n_layer=n_layer, n_head=heads,
                         n_kv_head=None if kv == heads else kv, head_size=None if head_dim * heads == d else head_dim,
                         max_seq_len=capacity, mlp="swiglu", norm="rmsnorm",
                         tie_embeddings=bool(f.get("tie_word_embeddings")), eps=eps,
                         mlp_hidden=f.int("intermediate_size"), activation=activation,
                         norm_layout=family.norm_layout, qk_norm=family.qk_norm, sliding_window=window,
                         sliding_layers=sliding, nope_layers=nope,
                         **_rope(f, head_dim, local, capacity), **_biases(f), **_scales(f, d))


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


def _hf_field(f: _Fields, ours: str) -> tuple[str, object] | None:
    """(config.json key, its value) that the converted field `ours` came from, or None."""
    candidates = HF_CONFIG_FIELDS.get(ours, ())
    for key in candidates:
        v = f.raw
        for part in key.split("."):
            v = v.get(part, MISSING) if isinstance(v, dict) else MISSING
        if v is not MISSING:
            return key, v
    return next(((key, f.defaults[key]) for key in candidates if key in f.defaults), None)


def _converted_field_error(f: _Fields, problem: str) -> ConvertError:
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


def hf_decoder_config(f: _Fields, max_seq_len: int | None = None) -> DecoderConfig:
    path = f.where.parent
    cfg = (gpt2_config if f.kind == "gpt2" else llama_config)(f, max_seq_len)
    cfg.extra = {"converted_from": {"model_type": f.kind, "path": str(path)}}
    try:
        cfg.validate()
    except ValueError as e:
        raise _converted_field_error(f, str(e)) from None
    return cfg


# --- weights ----------------------------------------------------------------------------------

@dataclass
class Param:
    """One Hugging Face tensor, the shape config.json implies for it, and what it becomes."""
    hf_name: str
    shape: tuple[int, ...]
    targets: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = field(default_factory=list)
    prefixed: bool = True        # stored under the base model's prefix (transformer. / model.); the head never is


def _same(t):
    return t


def _t(t):
    return t.t()


def gpt2_params(cfg: DecoderConfig, n_positions: int) -> list[Param]:
    """GPT-2's Conv1D stores [in, out]: transposed into nn.Linear's [out, in]; c_attn is q, k, v side by side."""
    d, hidden = cfg.d_model, cfg.hidden
    ps = [Param("wte.weight", (cfg.vocab_size, d), [("wte.weight", _same)]),
          # positions beyond the KV-cache capacity can never be used: their rows are dropped
          Param("wpe.weight", (n_positions, d), [("wpe.weight", lambda t: t[:cfg.max_seq_len])]),
          Param("ln_f.weight", (d,), [("ln_f.weight", _same)]), Param("ln_f.bias", (d,), [("ln_f.bias", _same)])]
    for i in range(cfg.n_layer):
        h, b = f"h.{i}.", f"blocks.{i}."
        split = [(f"{b}attn.{n}_proj.weight", lambda t, j=j: t[:, j * d:(j + 1) * d].t()) for j, n in enumerate("qkv")]
        split_b = [(f"{b}attn.{n}_proj.bias", lambda t, j=j: t[j * d:(j + 1) * d]) for j, n in enumerate("qkv")]
        ps += [Param(f"{h}ln_1.weight", (d,), [(f"{b}ln_1.weight", _same)]),
               Param(f"{h}ln_1.bias", (d,), [(f"{b}ln_1.bias", _same)]),
               Param(f"{h}attn.c_attn.weight", (d, 3 * d), split), Param(f"{h}attn.c_attn.bias", (3 * d,), split_b),
               Param(f"{h}attn.c_proj.weight", (d, d), [(f"{b}attn.out_proj.weight", _t)]),
               Param(f"{h}attn.c_proj.bias", (d,), [(f"{b}attn.out_proj.bias", _same)]),
               Param(f"{h}ln_2.weight", (d,), [(f"{b}ln_2.weight", _same)]),
               Param(f"{h}ln_2.bias", (d,), [(f"{b}ln_2.bias", _same)]),
               Param(f"{h}mlp.c_fc.weight", (d, hidden), [(f"{b}mlp.up_proj.weight", _t)]),
               Param(f"{h}mlp.c_fc.bias", (hidden,), [(f"{b}mlp.up_proj.bias", _same)]),
               Param(f"{h}mlp.c_proj.weight", (hidden, d), [(f"{b}mlp.down_proj.weight", _t)]),
               Param(f"{h}mlp.c_proj.bias", (d,), [(f"{b}mlp.down_proj.bias", _same)])]
    return ps


# HF norm names -> ours, by norm layout: the same HF name means another norm in another layout
# (Llama's post_attention_layernorm is the pre-MLP norm, Gemma 2's the norm of the attention's output)
NORM_NAMES = {"pre": {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2"},
              "sandwich": {"input_layernorm": "ln_1", "post_attention_layernorm": "post_attn_norm",
                           "pre_feedforward_layernorm": "ln_2", "post_feedforward_layernorm": "post_mlp_norm"},
              "post": {"post_attention_layernorm": "post_attn_norm", "post_feedforward_layernorm": "post_mlp_norm"}}


def _plus_one(t):
    return 1.0 + t      # Gemma's RMSNorm multiplies by (1 + w) in fp32: we store that effective gain


def _rows(start: int, stop: int):
    return lambda t: t[start:stop]


def llama_params(cfg: DecoderConfig, kind: str) -> list[Param]:
    """The llama-like families use nn.Linear ([out, in]) with the decoder's own projection names; Phi-3's
    fused qkv_proj / gate_up_proj are split by rows, Gemma's norm gains become 1 + w."""
    family = FAMILIES[kind]
    d, hidden, q, kv = cfg.d_model, cfg.hidden, cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    gain = _plus_one if family.gain_plus_one else _same
    ps = [Param("embed_tokens.weight", (cfg.vocab_size, d), [("wte.weight", _same)]),
          Param("norm.weight", (d,), [("ln_f.weight", gain)])]
    for i in range(cfg.n_layer):
        h, b = f"layers.{i}.", f"blocks.{i}."
        norms = [(theirs, ours) for theirs, ours in NORM_NAMES[cfg.norm_layout].items()]
        if cfg.qk_norm:
            norms += [("self_attn.q_norm", "attn.q_norm"), ("self_attn.k_norm", "attn.k_norm")]
        ps += [Param(f"{h}{theirs}.weight", (cfg.norm_width(ours),), [(f"{b}{ours}.weight", gain)])
               for theirs, ours in norms]
        if family.fused:
            ps += [Param(f"{h}self_attn.qkv_proj.weight", (q + 2 * kv, d),
                         [(f"{b}attn.q_proj.weight", _rows(0, q)), (f"{b}attn.k_proj.weight", _rows(q, q + kv)),
                          (f"{b}attn.v_proj.weight", _rows(q + kv, q + 2 * kv))]),
                   Param(f"{h}mlp.gate_up_proj.weight", (2 * hidden, d),     # chunk(2): the gate first
                         [(f"{b}mlp.gate_proj.weight", _rows(0, hidden)),
                          (f"{b}mlp.up_proj.weight", _rows(hidden, 2 * hidden))])]
            projections = [("self_attn.o_proj", "attn.out_proj", (d, q), cfg.out_bias),
                           ("mlp.down_proj", "mlp.down_proj", (d, hidden), cfg.mlp_bias)]
        else:
            projections = [("self_attn.q_proj", "attn.q_proj", (q, d), cfg.qkv_bias),
                           ("self_attn.k_proj", "attn.k_proj", (kv, d), cfg.qkv_bias),
                           ("self_attn.v_proj", "attn.v_proj", (kv, d), cfg.qkv_bias),
                           ("self_attn.o_proj", "attn.out_proj", (d, q), cfg.out_bias),
                           ("mlp.gate_proj", "mlp.gate_proj", (hidden, d), cfg.mlp_bias),
                           ("mlp.up_proj", "mlp.up_proj", (hidden, d), cfg.mlp_bias),
                           ("mlp.down_proj", "mlp.down_proj", (d, hidden), cfg.mlp_bias)]
        for theirs, ours, shape, bias in projections:
            ps.append(Param(f"{h}{theirs}.weight", shape, [(f"{b}{ours}.weight", _same)]))
            if bias:
                ps.append(Param(f"{h}{theirs}.bias", shape[:1], [(f"{b}{ours}.bias", _same)]))
    return ps


HEAD = "lm_head.weight"
# the embedding's name tells the two layouts apart (every family but gpt2 shares Llama's)
EMBEDDINGS = {"gpt2": ("wte.weight", "gpt2"), "llama": ("embed_tokens.weight", "llama-like")}


def expected_params(f: _Fields, cfg: DecoderConfig, head_stored: bool) -> tuple[list[Param], tuple[str, ...]]:
    """The tensors a folder of this kind must hold (the embedding first), and the prefixes its names may carry.

    A tied config's stored head is read too: transformers ties only a head equal to the embedding.
    """
    params = gpt2_params(cfg, f.int("n_positions")) if f.kind == "gpt2" else llama_params(cfg, f.kind)
    if not cfg.tie_embeddings or head_stored:
        params.append(Param(HEAD, (cfg.vocab_size, cfg.d_model), [("lm_head.weight", _same)], prefixed=False))
    return params, (("transformer.", "") if f.kind == "gpt2" else ("model.", ""))


def _config_fields(raw: dict, where: str) -> _Fields:
    _require_supported(raw.get("model_type"), where)
    return _Fields(Path(where), raw)


def decoder_config_of(raw: dict, max_seq_len: int | None = None, where: str = "config.json") -> DecoderConfig:
    """The DecoderConfig a Hugging Face config.json (a dict) converts to, without any folder (bench.gpu_decode
    builds random models of real shapes with it); ConvertError when the converter refuses the config."""
    return hf_decoder_config(_config_fields(raw, where), max_seq_len)


def hf_stored_tensors(raw: dict, where: str = "config.json") -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a save_pretrained folder of this config.json holds, from the layout
    tables above (bench/shapes.py writes random folders of real shapes with them); ConvertError when the
    config is one the converter refuses."""
    f = _config_fields(raw, where)
    cfg = hf_decoder_config(f)
    params, prefixes = expected_params(f, cfg, head_stored=not cfg.tie_embeddings)
    return [((prefixes[0] if p.prefixed else "") + p.hf_name, p.shape) for p in params]


def stores_gain_minus_one(model_type: str) -> bool:
    """Whether the family stores its RMSNorm gains as w with 1 + w applied (Gemma): a unit gain is stored as 0."""
    return model_type in FAMILIES and FAMILIES[model_type].gain_plus_one


def _file_problem(p: Path) -> str | None:
    """What is wrong with a name that is there but is no readable file; None when it is a file or absent."""
    if not os.path.lexists(p) or p.is_file():
        return None
    if p.is_symlink():
        try:
            p.stat()
        except OSError as e:
            if e.errno == errno.ELOOP:
                return "a symlink loop"
            return f"a broken symlink (to {os.readlink(p)}, which does not exist)"
    return "a directory" if p.is_dir() else "not a regular file"


def weight_files(path: Path) -> list[Path]:
    """The files holding the weights, in the order transformers prefers; ConvertError naming what is missing."""
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (TORCH_BIN, TORCH_BIN_INDEX)):
        if (path / single).is_file():
            return [path / single]
        if (path / index).is_file():
            try:
                weight_map = json.loads((path / index).read_text(encoding="utf-8"))["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
                raise ConvertError(f"{path / index}: expected a JSON object with a 'weight_map' of tensor -> shard file; "
                                   "re-save the folder") from None
            for s in shards:
                if not isinstance(s, str) or "/" in s or s in ("", ".", ".."):
                    raise ConvertError(f"{path / index}: shard name {s!r} is not a file name in the folder; re-save the folder")
                if problem := _file_problem(path / s):
                    raise ConvertError(f"{path / s}: expected a shard file, found {problem}; {index} lists it "
                                       "(copy the real shard into the folder)")
                if not (path / s).is_file():
                    raise ConvertError(f"{path / s}: missing; {index} lists it as a shard (copy every shard into the folder)")
            return [path / s for s in shards]
    # like transformers, a usable later file wins over a broken earlier one; with none, name the broken one
    for name in (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, TORCH_BIN_INDEX):
        if problem := _file_problem(path / name):
            raise ConvertError(f"{path / name}: expected a weights file, found {problem}; "
                               "put the real file there (or remove the name)")
    raise ConvertError(f"{path}: no weights found; expected {WEIGHT_FILES}")


@dataclass
class Stored:
    """One tensor of the folder: its shape from the file's header, its data read only when asked for."""
    file: Path
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]


def _unreadable(where: Path, reason: str) -> ConvertError:
    kind = "safetensors" if where.suffix == ".safetensors" else "PyTorch"
    return ConvertError(f"{where}: not a readable {kind} weights file ({reason[:200]}); re-download or re-save it")


def _pickle_callables(where: Path) -> list[str]:
    """The callables a pickle names (GLOBAL, STACK_GLOBAL, INST), read with pickletools: nothing is run.

    A pickle runs code by calling what it names; tensors name only torch's rebuild functions.
    torch's weights-only reader may stop earlier (at protocol 4's FRAME), so it cannot tell us.
    """
    import io
    import pickletools
    names: list[str] = []
    try:
        if zipfile.is_zipfile(where):
            with zipfile.ZipFile(where) as z:
                stream = io.BytesIO(z.read(next(n for n in z.namelist() if n.endswith("data.pkl"))))
        else:   # legacy format: a few pickles in a row (magic number, protocol, sys info, the state dict)
            stream = open(where, "rb")
        with stream:
            for _ in range(4):
                strings: list[str] = []
                for op, arg, _ in pickletools.genops(stream):
                    if op.name in ("GLOBAL", "INST"):    # protocols 0-2 say __builtin__, as Python 2 did
                        names.append(arg.replace(" ", ".").replace("__builtin__.", "builtins."))
                    elif op.name == "STACK_GLOBAL":
                        names.append(".".join(strings[-2:]))
                    elif isinstance(arg, str):
                        strings.append(arg)
    except Exception:   # damaged, or the end of a lone pickle: what was read so far
        pass
    return names


def _pickle_refused(where: Path, e: pickle.UnpicklingError) -> ConvertError:
    """torch's weights-only reader refused the file: say why in our words, never its advice to turn it off."""
    # a dotted name, not one of the rebuild functions tensors use (random bytes seldom spell one)
    code = [n for n in _pickle_callables(where) if re.fullmatch(r"[A-Za-z_][\w.]*\.\w+", n)
            and not n.startswith(("torch.", "collections.OrderedDict"))]
    if code:
        return ConvertError(f"{where}: expected a pickle of tensors only, found one that calls {code[0]}; "
                            "refused because loading it could run code (load only files you trust; convert it "
                            "to safetensors with a tool you trust)")
    reason = next((line.strip() for line in str(e).splitlines() if line.strip() and "weights_only" not in line
                   and not line.startswith(("Weights only load failed", "Check the documentation"))), "damaged")
    return _unreadable(where, reason)


def read_safetensor(where: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open
    with safe_open(str(where), framework="pt") as handle:
        return handle.get_tensor(name)


def read_safetensor_rows(where: Path, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of dim 0 of one tensor: only their bytes are read from the mapped file."""
    from safetensors import safe_open
    with safe_open(str(where), framework="pt") as handle:
        return handle.get_slice(name)[start:stop]


def _read_file(where: Path) -> dict[str, Stored]:
    """The tensors of one weights file by name; the data of a safetensors file stays on disk until read."""
    try:
        if where.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(where), framework="pt") as handle:
                shapes = {n: tuple(handle.get_slice(n).get_shape()) for n in handle.keys()}
            # opened again for each read: a handle kept open keeps every page it read mapped (resident)
            return {n: Stored(where, shape, lambda n=n: read_safetensor(where, n)) for n, shape in shapes.items()}
        with warnings.catch_warnings():     # a damaged pickle warns before it fails: one line only
            warnings.simplefilter("ignore")
            # memory-mapped where the format allows it (zip, torch >= 1.6): shapes now, data when used
            state = torch.load(where, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(where))
    except pickle.UnpicklingError as e:
        raise _pickle_refused(where, e) from None
    except Exception as e:  # safetensors, pickle and zip readers raise many types on a damaged file
        raise _unreadable(where, first_line(e)) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConvertError(f"{where}: expected a state dict of tensors, found {type(state).__name__}; re-save the folder")
    return {n: Stored(where, tuple(t.shape), lambda t=t: t) for n, t in state.items()}


def read_weights(path: Path) -> dict[str, Stored]:
    """Every tensor of the folder by name (shapes only: nothing is read yet)."""
    out: dict[str, Stored] = {}
    for f in weight_files(path):
        out.update(_read_file(f))
    return out


def _check_layout(path: Path, f: _Fields, stored: dict[str, Stored], expected: str) -> None:
    """The embedding is missing: if the other layout's is there, config.json and the weights are different models."""
    embedding, family = EMBEDDINGS["llama" if f.kind == "gpt2" else "gpt2"]
    found = next((n for n in stored if n == embedding or n.endswith("." + embedding)), None)
    if found:
        raise ConvertError(f"{path}: config.json says model_type {f.kind!r}, but the weights are a {family} model's "
                           f"(they hold {found!r}, not {expected!r}); use the config.json that came with the weights")


def plan_weights(path: Path, f: _Fields, cfg: DecoderConfig, stored: dict[str, Stored]) -> list[tuple[Param, str]]:
    """Which stored tensor fills each expected one, checked by name and shape before any data is read."""
    params, prefixes = expected_params(f, cfg, head_stored=HEAD in stored)
    # missing names are given as the user's file spells them: with the prefix its embedding has
    prefix = next((pre for pre in prefixes if pre + params[0].hf_name in stored), prefixes[0])
    plan = []
    for p in params:
        names = [pre + p.hf_name for pre in prefixes] if p.prefixed else [p.hf_name]
        if p is params[0] and cfg.tie_embeddings:
            names.append(HEAD)      # transformers ties a missing embedding to the stored head (tie_weights swaps)
        name = next((n for n in names if n in stored), None)
        if name is None:
            theirs = prefix + p.hf_name if p.prefixed else p.hf_name
            if p is params[0]:
                _check_layout(path, f, stored, theirs)
            raise ConvertError(f"{path}: the weights lack tensor {theirs!r} that config.json implies "
                               f"(looked in {', '.join(sorted({s.file.name for s in stored.values()}))}); "
                               "the folder is incomplete or its config.json belongs to another model")
        t = stored[name]
        if t.shape != p.shape:
            raise ConvertError(f"{t.file}: tensor {name!r} has shape {list(t.shape)}; config.json implies "
                               f"{list(p.shape)} (the weights and config.json disagree: re-save the folder)")
        plan.append((p, name))
    used = {name for _, name in plan}
    extra = sorted(n for n in stored if n not in used and not IGNORED.match(n))
    if extra:
        raise ConvertError(f"{stored[extra[0]].file}: tensor {extra[0]!r} has no place in the {f.kind} layout "
                           f"({len(extra)} such tensor(s)); the model has parts the converter does not support")
    return plan


def load_weights(f: _Fields, cfg: DecoderConfig, stored: dict[str, Stored], plan: list[tuple[Param, str]]) -> dict:
    """Our state dict (fp32), one stored tensor read at a time; unties a tied config whose stored head differs."""
    state = {}
    for p, name in plan:
        src = stored[name].file
        try:
            t = stored[name].read()
        except Exception as e:      # a file damaged past its header
            raise _unreadable(src, first_line(e)) from None
        if not t.is_floating_point():
            raise ConvertError(f"{src}: tensor {name!r} has dtype {str(t.dtype).replace('torch.', '')}; "
                               "expected floating-point weights")
        for ours, fn in p.targets:
            state[ours] = fn(t.to(torch.float32)).contiguous()
    if cfg.tie_embeddings and "lm_head.weight" in state:
        head = state.pop("lm_head.weight")
        if not torch.equal(head, state["wte.weight"]):
            # transformers (modeling_utils.tie_weights) keeps both when they differ, whatever config.json says
            cfg.tie_embeddings = False
            state["lm_head.weight"] = head
            f.notes.append(f"{f.where} sets tie_word_embeddings, but the stored {HEAD} differs from the embedding: "
                           "kept untied, as transformers does (set tie_word_embeddings to false to say so)")
    return state


@dataclass
class WeightPlan:
    """A Hugging Face folder mapped without reading it whole: what models/weights.py streams."""
    raw: dict
    cfg: DecoderConfig
    places: dict[str, tuple[Stored, Callable[[torch.Tensor], torch.Tensor]]]   # ours -> (stored tensor, map)
    notes: list[str]
    # ours -> the tensor's name in the folder's files (model.layers.0.mlp.up_proj.weight for
    # blocks.0.mlp.up_proj.weight): what a refusal of a stored tensor names
    names: dict[str, str] = field(default_factory=dict)


def hf_weight_plan(path: str | os.PathLike, max_seq_len: int | None = None) -> WeightPlan:
    """The config and the tensor map of an HF folder, checked against the files' headers (the
    tie rule reads the embedding and the stored head once, as load_weights does)."""
    path = Path(path)
    raw = read_hf_config(path)
    f = _Fields(path / CONFIG, raw)
    cfg = hf_decoder_config(f, max_seq_len)
    stored = read_weights(path)
    planned = [(ours, name, fn) for p, name in plan_weights(path, f, cfg, stored) for ours, fn in p.targets]
    places = {ours: (stored[name], fn) for ours, name, fn in planned}
    names = {ours: name for ours, name, _ in planned}
    if cfg.tie_embeddings and "lm_head.weight" in places:
        head, emb = places["lm_head.weight"], places["wte.weight"]
        if torch.equal(head[1](head[0].read()), emb[1](emb[0].read())):
            del places["lm_head.weight"]
        else:
            cfg.tie_embeddings = False
            f.notes.append(f"{f.where} sets tie_word_embeddings, but the stored {HEAD} differs from the embedding: "
                           "kept untied, as transformers does (set tie_word_embeddings to false to say so)")
    if cfg.tie_embeddings:
        places["lm_head.weight"] = places["wte.weight"]
        names["lm_head.weight"] = names["wte.weight"]
    return WeightPlan(raw, cfg, places, _folder_notes(path, raw, cfg, f.notes), names)


# --- the whole folder -------------------------------------------------------------------------

@dataclass
class Converted:
    model: Decoder
    tokenizer: Path | None        # HF_DIR/tokenizer.json, or None
    model_type: str
    notes: list[str]


def convert(path: str | os.PathLike, max_seq_len: int | None = None) -> Converted:
    """The decoder (eval mode, fp32) of an HF folder, its tokenizer.json if any, and what to tell the user."""
    from core.inputs import check_memory
    path = Path(path)
    raw = read_hf_config(path)
    f = _Fields(path / CONFIG, raw)
    cfg = hf_decoder_config(f, max_seq_len)
    stored = read_weights(path)
    plan = plan_weights(path, f, cfg, stored)     # names and shapes first: a mismatch is named, not sized
    kept_head = cfg.vocab_size * cfg.d_model if cfg.tie_embeddings and HEAD in stored else 0   # may stay untied
    check_memory(3 * 4 * (cfg.approx_param_count() + kept_head), f"{path}: converting the model it holds",
                 "convert on a machine with more memory")
    state = load_weights(f, cfg, stored, plan)
    del stored, plan
    with torch.device("meta"):
        model = Decoder(cfg)
    model = model.to_empty(device="cpu")
    for rotary in model.rotaries().values():     # non-persistent buffers: recomputed, not loaded
        rotary.reset_parameters()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    assert not missing and not unexpected, (missing, unexpected)   # expected_params covers the model exactly
    if cfg.tie_embeddings:
        model.lm_head.weight = model.wte.weight
    for name, t in model.state_dict().items():
        if not all_finite(t):
            raise ConvertError(f"{path}: tensor for {name!r} contains NaN or Inf; the weights are corrupt")
    notes = _folder_notes(path, raw, cfg, f.notes)
    tok = path / TOKENIZER if (path / TOKENIZER).is_file() else None
    return Converted(model.eval(), tok, raw["model_type"], notes)


def _folder_notes(path: Path, raw: dict, cfg: DecoderConfig, notes: list[str]) -> list[str]:
    """What to tell the user of a folder (capacity, the converter's notes, a missing tokenizer);
    checks the tokenizer fits."""
    notes = [f"converted Hugging Face {raw['model_type']} folder {path}: capacity {cfg.max_seq_len} tokens", *notes]
    if (path / TOKENIZER).is_file():
        check_tokenizer_fits(path, cfg.vocab_size)
    else:
        notes.append(f"no {TOKENIZER} in {path}: the model converts, exports and builds, but generation needs a "
                     f"tokenizer (save one with AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR), "
                     f"then convert again or copy it beside the model)")
    return notes


# --- CLI --------------------------------------------------------------------------------------

def run(argv: list[str]) -> int:
    from core.errors import ArgumentParser, int_in
    from core.outputs import CHECKPOINT, check_output_dir
    from models.checkpoint import save_checkpoint
    p = ArgumentParser(prog="python -m models.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("hf_dir", type=Path, metavar="HF_DIR", help=f"a Hugging Face model folder ({', '.join(SUPPORTED)})")
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write (new, or an earlier checkpoint)")
    p.add_argument("--max-seq-len", type=int_in(1, 1 << 20), default=None,
                   help=f"KV-cache capacity (default: the model's maximum, at most {DEFAULT_CAPACITY})")
    a = p.parse_args(argv)
    check_output_dir(a.out, CHECKPOINT, inputs=[a.hf_dir])
    c = convert(a.hf_dir, a.max_seq_len)
    from core.generation import write_model_files
    # the chat template with its special tokens, and the stop tokens, travel beside tokenizer.json
    # (core/chat_template.py, core/generation.py)
    save_checkpoint(c.model, a.out, c.tokenizer, inputs=[a.hf_dir], write_more=lambda tmp: write_model_files(a.hf_dir, tmp))
    cfg = c.model.cfg
    for note in c.notes[1:]:
        print(f"note: {note}", file=sys.stderr)
    print(f"{a.out}: {c.model_type} -> {cfg.norm}, {c.model.num_params():,} params, d_model {cfg.d_model}, "
          f"{cfg.n_layer} layers, {cfg.n_head} heads ({cfg.kv_heads} key/value), capacity {cfg.max_seq_len}, "
          f"{'with' if c.tokenizer else 'without'} tokenizer.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    from core.lifecycle import run_cli
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
