"""The rope settings of a Hugging Face config.json as the installed transformers reads them.

`rope_fields` gives the decoder's rope fields (rope_theta, rope_scaling, rotary_dim, and the
sliding layers' own base: local_rope_theta / local_rope_layers), refusing what the decoder
cannot compute in one line. What differs by family is read off its record (models/families.py):
legacy rope type names (`rope_aliases`), rope settings per layer type (`rope_per_layer_type`),
a partial rotary factor honoured with default rope (`partial_rope`).
"""
from __future__ import annotations

from models.hf_fields import LAYER_TYPES, MISSING, ConfigFields
from models.rope import ROPE_NEEDS, YARN_OPTIONAL

def _rope_settings(f: ConfigFields) -> tuple[str, dict]:
    """The rope settings as the installed transformers reads them, and the key they came from.

    PreTrainedConfig.convert_rope_params_to_dict / standardize_rope_params (transformers 5): a
    non-empty rope_scaling replaces rope_parameters whole (its rope_theta too); rope_theta and
    partial_rotary_factor at the top level fill what the dict leaves out; rope_type defaults to
    the legacy 'type', then 'default'; a scaled rope's original length is the top-level
    original_max_position_embeddings (Phi-3 keeps it there) or max_position_embeddings. Per layer
    type (nested dicts): read by _per_layer_type_rope in a family whose record says so (Gemma 3);
    refused elsewhere (those families' rotary embeddings read one set).
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


def _standardized(f: ConfigFields, chosen: dict, theta) -> dict:
    p = dict(chosen)
    p.setdefault("rope_theta", theta)
    if f.raw.get("partial_rotary_factor") is not None:
        p.setdefault("partial_rotary_factor", f.raw["partial_rotary_factor"])
    p.setdefault("rope_type", p.get("type", "default"))
    aliases = f.family.rope_aliases     # legacy names of a rope type (Phi3Config's of longrope)
    if isinstance(p["rope_type"], str) and p["rope_type"] in aliases:
        p["rope_type"] = aliases[p["rope_type"]]
    if p["rope_type"] in ("llama3", "yarn", "longrope"):
        if f.raw.get("original_max_position_embeddings") is not None:
            p["original_max_position_embeddings"] = f.raw["original_max_position_embeddings"]
        else:
            p.setdefault("original_max_position_embeddings", f.get("max_position_embeddings"))
    if p["rope_type"] in ("yarn", "longrope") and p.get("factor") is None:   # transformers' own default factor
        p["factor"] = f.get("max_position_embeddings") / p["original_max_position_embeddings"]
    return p


def _per_layer_type_rope(f: ConfigFields) -> tuple[str, dict, dict]:
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


def _one_rope(f: ConfigFields, key: str, params: dict) -> tuple[float, dict | None]:
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


def rope_fields(f: ConfigFields, head_dim: int, local_layers: list[int], capacity: int) -> dict:
    """The decoder's rope fields (theta, scaling, rotary_dim; the base of the layers whose layer type is
    sliding_attention, local_layers, whether or not their window survives as a mask)."""
    family = f.family
    local = None
    if family.rope_per_layer_type:
        key, params, local = _per_layer_type_rope(f)
    else:
        key, params = _rope_settings(f)
    theta, scaling = _one_rope(f, key, params)
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
        local_theta, local_scaling = _one_rope(f, "rope_parameters.sliding_attention", local)
        if local_scaling is not None:
            f.unsupported(f"rope type {local_scaling['rope_type']!r} on the sliding layers")
        if local_theta != theta or scaling is not None:
            out.update(local_rope_theta=local_theta, local_rope_layers=list(local_layers))
    return out
