"""Hugging Face model folders -> our checkpoint: config, weights and tokenizer.

    python -m models.convert HF_DIR --out CKPT [--max-seq-len N]

HF_DIR is a folder as `save_pretrained` writes it: config.json (model_type one of
SUPPORTED), the weights as model.safetensors, sharded safetensors with
model.safetensors.index.json, or pytorch_model.bin (sharded with
pytorch_model.bin.index.json), and tokenizer.json when the model has a fast
tokenizer. CKPT is a checkpoint (models/checkpoint.py, format 2) that export.build,
runtime.generate --backend torch and train.finetune read; `export.build
--checkpoint HF_DIR` converts in memory with the same code.

This module is the conversion driver and its CLI. The parts it drives:

    models/families.py    one record per model_type (gpt2, llama, mistral, qwen2, qwen3, gemma,
                          gemma2, gemma3_text, phi3, olmo2, smollm3, granite): defaults, layout,
                          norms, rope and activation reading, the rules its config class computes
    models/hf_fields.py   config.json read key by key with the family's defaults; the capacity rule
    models/hf_rope.py     the rope settings as transformers reads them
    models/hf_config.py   the DecoderConfig (GPT-2's layout, or Llama's with what the family adds)
    models/hf_layout.py   the tensors a folder holds and what each becomes
    models/hf_files.py    the weight files, read by tensor name; pickle safety

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

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from core.errors import first_line
from models.checkpoint import CONFIG, TOKENIZER, all_finite, check_tokenizer_fits
from models.decoder import Decoder, DecoderConfig
# the converter's public names, where callers have always imported them (models.convert)
from models.families import FAMILIES, HF_DEFAULTS, LAYOUTS, SUPPORTED, family_of  # noqa: F401
from models.hf_fields import DEFAULT_CAPACITY, MIN_CAPACITY, ConfigFields, converted_field_error  # noqa: F401
from models.hf_files import ConvertError, Stored, read_weights, unreadable
from models.hf_layout import HEAD, IGNORED, Param, same

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
    family_of(raw.get("model_type"), where)
    return raw


def is_hf_folder(path: str | os.PathLike) -> bool:
    """A folder whose config.json names a model_type and is not one of our checkpoints."""
    try:
        raw = json.loads((Path(path) / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(raw, dict) and "model_type" in raw and "format" not in raw


def _fields(raw: dict, where: str | os.PathLike) -> ConfigFields:
    """config.json's fields, read with its family's record (refused in one line when the model_type has none)."""
    return ConfigFields(Path(where), raw, family_of(raw.get("model_type"), where))



def hf_decoder_config(f: ConfigFields, max_seq_len: int | None = None) -> DecoderConfig:
    """The DecoderConfig of the family's layout, validated; a refusal names the user's config.json field."""
    path = f.where.parent
    cfg = f.family.layout.decoder_config(f, max_seq_len)
    cfg.extra = {"converted_from": {"model_type": f.kind, "path": str(path)}}
    try:
        cfg.validate()
    except ValueError as e:
        raise converted_field_error(f, str(e)) from None
    return cfg


def expected_params(f: ConfigFields, cfg: DecoderConfig, head_stored: bool) -> tuple[list[Param], tuple[str, ...]]:
    """The tensors a folder of this kind must hold (the embedding first), and the prefixes its names may carry.

    A tied config's stored head is read too: transformers ties only a head equal to the embedding.
    """
    params = f.family.layout.params(f, cfg)
    if not cfg.tie_embeddings or head_stored:
        params.append(Param(HEAD, (cfg.vocab_size, cfg.d_model), [("lm_head.weight", same)], prefixed=False))
    return params, f.family.layout.prefixes


def decoder_config_of(raw: dict, max_seq_len: int | None = None, where: str = "config.json") -> DecoderConfig:
    """The DecoderConfig a Hugging Face config.json (a dict) converts to, without any folder (bench.gpu_decode
    builds random models of real shapes with it); ConvertError when the converter refuses the config."""
    return hf_decoder_config(_fields(raw, where), max_seq_len)


def hf_stored_tensors(raw: dict, where: str = "config.json") -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a save_pretrained folder of this config.json holds, from the family's
    layout (models/hf_layout.py; bench/shapes.py writes random folders of real shapes with them); ConvertError when the
    config is one the converter refuses."""
    f = _fields(raw, where)
    cfg = hf_decoder_config(f)
    params, prefixes = expected_params(f, cfg, head_stored=not cfg.tie_embeddings)
    return [((prefixes[0] if p.prefixed else "") + p.hf_name, p.shape) for p in params]


def stores_gain_minus_one(model_type: str) -> bool:
    """Whether the family stores its RMSNorm gains as w with 1 + w applied (Gemma): a unit gain is stored as 0."""
    return model_type in FAMILIES and FAMILIES[model_type].gain_plus_one


# --- weights ----------------------------------------------------------------------------------

def _check_layout(path: Path, f: ConfigFields, stored: dict[str, Stored], expected: str) -> None:
    """The embedding is missing: if the other layout's is there, config.json and the weights are different models."""
    other = next(layout for layout in LAYOUTS if layout is not f.family.layout)
    found = next((n for n in stored if n == other.embedding or n.endswith("." + other.embedding)), None)
    if found:
        raise ConvertError(f"{path}: config.json says model_type {f.kind!r}, but the weights are a {other.name} model's "
                           f"(they hold {found!r}, not {expected!r}); use the config.json that came with the weights")


def plan_weights(path: Path, f: ConfigFields, cfg: DecoderConfig, stored: dict[str, Stored]) -> list[tuple[Param, str]]:
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


def load_weights(f: ConfigFields, cfg: DecoderConfig, stored: dict[str, Stored], plan: list[tuple[Param, str]]) -> dict:
    """Our state dict (fp32), one stored tensor read at a time; unties a tied config whose stored head differs."""
    state = {}
    for p, name in plan:
        src = stored[name].file
        try:
            t = stored[name].read()
        except Exception as e:      # a file damaged past its header
            raise unreadable(src, first_line(e)) from None
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
    f = _fields(raw, path / CONFIG)
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
    f = _fields(raw, path / CONFIG)
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
