"""Checkpoint format: a directory with config.json, model.safetensors and (usually) tokenizer.json.

config.json is flat: every DecoderConfig field, plus at top level
    "format": 3,
    "norm": "rmsnorm" | "layernorm" | "taper" | "dyt",
    "taper_scope": "internal" | "all" | null,
    "gate": float in [0, 1] (null when not taper),
    "taper_c": {"blocks.0.ln_1": c, ...} (taper only; every TaperNorm layer),
    "has_tokenizer": true | false (false: converted from a folder without tokenizer.json;
                     the model loads, exports and builds, generation needs a tokenizer).
Format 1 (before the Hugging Face families) had no rope / grouped-query / bias /
MLP-width / activation / per-norm eps fields and always a tokenizer: it is read
by filling those with what format 1 meant (`_upgrade`), so the zoo and every
older checkpoint keep loading. Format 2 (before the 2026 families) had no norm-layout / QK-norm /
scale / soft-cap / sliding-window / NoPE fields: read the same way, with what format 2 meant. A tied LM head is stored once (as wte.weight).
Loading validates everything and raises CheckpointError with one line naming the
file and field.

    python -m models.checkpoint DIR      # validate and summarize a checkpoint
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import functools
import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from core.errors import UserError, first_line
from core.lifecycle import run_cli
from core.inputs import check_memory
from core.outputs import CHECKPOINT, OutputKind, output_dir, writing
from models.decoder import Decoder, DecoderConfig
from models.rope import check_rope
from models.disabled_norm import DISABLED_NORM_EPS  # noqa: F401  (re-exported: export and graph_passes' test read it here)

FORMAT_VERSION = 3
READS_FORMATS = (1, 2, 3)
CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"
NEEDS = f"a checkpoint directory needs {CONFIG}, {WEIGHTS} and {TOKENIZER}"
# what format 1 meant by the fields format 2 added (and DecoderConfig's defaults may not always say)
FORMAT_1_MEANT = dict(n_kv_head=None, head_size=None, pos_embedding="learned", rope_theta=10000.0, rotary_dim=None,
                      rope_scaling=None, qkv_bias=True, out_bias=True, mlp_bias=True, mlp_hidden=None,
                      activation=None, layer_eps={}, has_tokenizer=True)
# what format 2 meant by the fields format 3 added (the 2026 families: models/decoder.py)
FORMAT_2_MEANT = dict(norm_layout="pre", qk_norm=None, embed_scale=1.0, attn_scale=None, attn_softcap=None,
                      final_softcap=None, residual_scale=1.0, logits_divisor=1.0, sliding_window=None,
                      sliding_layers=[], local_rope_theta=None, local_rope_layers=None, nope_layers=[])


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded; the message is one line naming the file and field."""


def _read_config(path: Path) -> dict:
    where = path / CONFIG
    if where.is_dir():
        raise CheckpointError(f"{where}: expected a JSON file, found a directory; {NEEDS}")
    try:
        raw_bytes = where.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{where}: missing; {NEEDS}") from None
    except OSError as e:
        raise CheckpointError(f"{where}: expected a readable file, found {(e.strerror or 'an error').lower()}; "
                              "check its permissions") from None
    try:
        text = raw_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: expected UTF-8 JSON, found an undecodable byte at offset {e.start}; "
                              "fix or re-save the checkpoint") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix or re-save the checkpoint") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: expected a JSON object, found {type(raw).__name__}")
    return raw


def _upgrade(where: Path, raw: dict) -> dict:
    """A format-1 or format-2 config as the current format: the fields added since set to what its format meant."""
    fmt = raw["format"]
    meant = {**(FORMAT_1_MEANT if fmt == 1 else {}), **FORMAT_2_MEANT}
    added = sorted(k for k in meant if k in raw)
    if added:
        later = "format-2 or -3" if fmt == 1 else "format-3"
        raise CheckpointError(f"{where}: format {fmt} with {later} field(s) {', '.join(added)}; "
                              f"expected one or the other: set 'format' to {FORMAT_VERSION}, or drop those fields")
    return {**raw, **meant, "format": FORMAT_VERSION}


def _validate_config(path: Path, raw: dict, memory: bool = True) -> DecoderConfig:
    where = path / CONFIG
    if "format" not in raw and isinstance(raw.get("model_type"), str):
        raise CheckpointError(f"{path}: a Hugging Face model folder (model_type {raw['model_type']!r}), not a checkpoint; "
                              f"convert it with python -m models.convert {path} --out CKPT (export.build "
                              "--checkpoint takes it as it is)")
    fmt = raw.get("format")
    if isinstance(fmt, bool) or fmt not in READS_FORMATS:
        raise CheckpointError(f"{where}: field 'format' is {fmt!r}; expected one of {', '.join(map(str, READS_FORMATS))} "
                              "(a checkpoint of python -m train or python -m models.convert)")
    if fmt != FORMAT_VERSION:
        raw.update(_upgrade(where, raw))
    if not isinstance(raw.get("has_tokenizer"), bool):
        raise CheckpointError(f"{where}: field 'has_tokenizer' is {raw.get('has_tokenizer')!r}; expected true or false")
    try:
        cfg = DecoderConfig.from_dict(raw)
        cfg.validate()
        if cfg.pos_embedding == "rope":      # what validate's key check cannot see (models/rope.py check_rope)
            check_rope(cfg.rope_theta, cfg.rotary_dim or cfg.head_dim, cfg.rope_scaling)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: field {e}") from None
    # weights in the model plus the loaded tensors, fp32: refuse before allocating (not when
    # the weights are streamed a tensor at a time: models/weights.py)
    if memory:
        check_memory(2 * 4 * cfg.approx_param_count(), f"{where}: the model it describes",
                 "check vocab_size, d_model, n_layer and max_seq_len")
    gate = raw.get("gate")
    if cfg.norm == "taper":
        if isinstance(gate, bool) or not isinstance(gate, (int, float)) or not 0.0 <= gate <= 1.0:
            raise CheckpointError(f"{where}: field 'gate' is {gate!r}; expected a number in [0, 1] for a taper model")
    elif gate is not None:
        raise CheckpointError(f"{where}: field 'gate' is {gate!r}; expected null for norm {cfg.norm!r}")
    return cfg


def _apply_taper_c(where: Path, model: Decoder, taper_c) -> None:
    layers = model.taper_layers()
    if not layers:
        return
    if not isinstance(taper_c, dict) or set(taper_c) != set(layers):
        found = sorted(taper_c) if isinstance(taper_c, dict) else taper_c
        raise CheckpointError(f"{where}: field 'taper_c' has layers {found}; expected one c for each of {sorted(layers)}")
    for name, c in taper_c.items():
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c):
            raise CheckpointError(f"{where}: field 'taper_c.{name}' is {c!r}; expected a finite number")
        layers[name].c = float(c)


def _stored_state(model: Decoder) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight")  # same storage as wte.weight; stored once
    return state


def _load_weights(path: Path, model: Decoder) -> None:
    where = path / WEIGHTS
    if not where.is_file():
        raise CheckpointError(f"{where}: missing; {NEEDS}")
    if not os.access(where, os.R_OK):
        raise CheckpointError(f"{where}: expected a readable file, found permission denied; check its permissions")
    try:
        tensors = load_file(str(where))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{where}: not a readable safetensors file ({first_line(e)}); re-save the checkpoint") from None
    expected = _stored_state(model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where}: tensors disagree with config.json (missing {missing}, unexpected {unexpected})")
    for name, ref in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(f"{where}: tensor '{name}' has shape {list(t.shape)}; config.json implies {list(ref.shape)}")
        if not t.is_floating_point():
            raise CheckpointError(f"{where}: tensor '{name}' has dtype {str(t.dtype).replace('torch.', '')}; "
                                  "expected a floating-point weight; re-save the checkpoint")
        if not all_finite(t):
            raise CheckpointError(f"{where}: tensor '{name}' contains NaN or Inf; the checkpoint is corrupt (retrain or restore it)")
    model.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()}, strict=False)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in `t`. A finite sum implies it (a NaN or an Inf makes the sum NaN or Inf), and
    the sum reads the tensor once without the bool copy isfinite() writes: ~40x faster on a 235 MB
    matrix, which matters when an 8B model's weights are all checked. A sum that overflows is
    checked element by element."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def read_checkpoint_config(path: Path, memory_check: bool = True) -> tuple[dict, DecoderConfig]:
    """config.json of a checkpoint directory, validated: (the raw JSON, the DecoderConfig).
    memory_check: refuse a model that cannot be loaded whole (off when it is streamed)."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory (expected a folder with {CONFIG}, {WEIGHTS}, {TOKENIZER})")
    raw = _read_config(path)
    return raw, _validate_config(path, raw, memory_check)


def apply_taper_state(where: Path, model: Decoder, raw: dict) -> None:
    """The per-layer c and the gate of config.json (`where`), set on `model` (no-op unless taper)."""
    _apply_taper_c(where, model, raw.get("taper_c"))
    if model.cfg.norm == "taper":
        model.set_gate(raw["gate"])


def load_checkpoint(path: str | os.PathLike) -> Decoder:
    """Validated model in eval mode, gate and per-layer c applied."""
    path = Path(path)
    raw, cfg = read_checkpoint_config(path)
    check_checkpoint_tokenizer(path, raw, cfg)
    model = Decoder(cfg)
    apply_taper_state(path / CONFIG, model, raw)
    _load_weights(path, model)
    return model.eval()


def check_checkpoint_tokenizer(path: Path, raw: dict, cfg: DecoderConfig) -> None:
    """The tokenizer.json config.json says the checkpoint has: there, and within the model's vocabulary."""
    if raw["has_tokenizer"]:
        if not (path / TOKENIZER).is_file():
            raise CheckpointError(f"{path / TOKENIZER}: missing; {NEEDS}")
        check_tokenizer_fits(path, cfg.vocab_size)


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer (tokenizers.Tokenizer) from DIR/tokenizer.json."""
    where = Path(path) / TOKENIZER
    if where.is_dir() or not where.exists():
        why = ("the model was converted from a folder without one, and generation needs it: "
               if not where.exists() and has_tokenizer(path) is False else "")
        raise CheckpointError(f"{where}: expected a tokenizer.json file, found {'a directory' if where.is_dir() else 'nothing'}; "
                              f"{why}copy the tokenizer the model was trained with there")
    stat = where.stat()
    try:
        return _tokenizer_file(str(where.resolve()), stat.st_mtime_ns, stat.st_size)
    except Exception as e:  # tokenizers raises plain Exception on bad files
        raise CheckpointError(f"{where}: not a readable tokenizer.json ({first_line(e)})") from None


@functools.lru_cache(maxsize=4)
def _tokenizer_file(where: str, mtime_ns: int, size: int):
    """One parse per file and version (a Llama 3 tokenizer.json takes 0.5 s; a build reads it twice): callers
    share the object and only encode and decode with it."""
    from tokenizers import Tokenizer
    return Tokenizer.from_file(where)


def has_tokenizer(path: str | os.PathLike) -> bool | None:
    """What the checkpoint's config.json says about its tokenizer (None: unreadable or not said)."""
    try:
        value = json.loads((Path(path) / CONFIG).read_text()).get("has_tokenizer")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, bool) else None


def check_tokenizer_fits(path: str | os.PathLike, vocab_size: int, tokenizer=None) -> None:
    """Every token id the tokenizer can produce must index the model's vocabulary."""
    tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise CheckpointError(f"{Path(path) / TOKENIZER}: has {n} tokens, the model's vocab_size is {vocab_size}; "
                              "ids >= vocab_size would crash generation: use the tokenizer the model was trained with")


def checkpoint_config(model: Decoder, has_tokenizer: bool = True) -> dict:
    cfg = model.cfg.to_dict()
    taper = model.cfg.norm == "taper"
    return {"format": FORMAT_VERSION, **cfg,
            "gate": model.gate.value if taper else None,
            "taper_c": model.taper_c() if taper else None,
            "has_tokenizer": has_tokenizer}


def write_checkpoint_files(model: Decoder, directory: Path, tokenizer_json: str | os.PathLike | None,
                           extra_files: dict[str, str | os.PathLike] | None = None) -> None:
    """config.json, model.safetensors, tokenizer.json (copied; None: none) and extra files, into `directory`."""
    directory = Path(directory)
    with writing(directory / CONFIG):          # each write names its file (safetensors' errors name none)
        config = checkpoint_config(model, tokenizer_json is not None)
        (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in _stored_state(model).items()}
    with writing(directory / WEIGHTS):
        save_file(state, str(directory / WEIGHTS))
    copies = {TOKENIZER: tokenizer_json} if tokenizer_json is not None else {}
    for name, src in {**copies, **(extra_files or {})}.items():
        with writing(directory / name):
            shutil.copyfile(src, directory / name)


def save_checkpoint(model: Decoder, path: str | os.PathLike, tokenizer_json: str | os.PathLike | None,
                    extra_files: dict[str, str | os.PathLike] | None = None,
                    kind: OutputKind = CHECKPOINT, inputs=(), write_more=None) -> Path:
    """Write a checkpoint directory atomically (core.outputs.output_dir: replaces only our own `kind`).

    tokenizer_json: path of a tokenizer.json to copy in (None: a checkpoint without one); extra_files: name -> source
    path of further files to copy (e.g. the training log); write_more: a function of the temporary folder that
    writes further files into it (a training run's log and resume state: written once, where they stay);
    inputs: paths the command reads, which `path` must not be or hold.
    """
    with output_dir(path, kind, inputs=inputs) as tmp:
        write_checkpoint_files(model, tmp, tokenizer_json, extra_files)
        if write_more is not None:
            write_more(tmp)
    return Path(path)


def run(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        from core.errors import UsageError
        raise UsageError("python -m models.checkpoint: expected one argument, CHECKPOINT_DIR; see the module docstring")
    model = load_checkpoint(argv[0])
    cfg = model.cfg
    gate = f", gate {model.gate.value}" if cfg.norm == "taper" else ""
    scope = f" ({cfg.taper_scope})" if cfg.taper_scope else ""
    kv = f" ({cfg.kv_heads} key/value)" if cfg.kv_heads != cfg.n_head else ""
    pos = f", rope theta {cfg.rope_theta:g}" if cfg.pos_embedding == "rope" else ""
    tok = "; no tokenizer.json (generation needs one)" if has_tokenizer(argv[0]) is False else ""
    print(f"{argv[0]}: ok: {cfg.norm}{scope}{gate}, {model.num_params():,} params, "
          f"d_model {cfg.d_model}, {cfg.n_layer} layers, {cfg.n_head} heads{kv}, vocab {cfg.vocab_size}, "
          f"capacity {cfg.max_seq_len}{pos}{tok}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
