"""Checkpoint format: a directory with config.json, model.safetensors, tokenizer.json.

config.json is flat: the DecoderConfig fields, plus at top level
    "format": 1,
    "norm": "rmsnorm" | "layernorm" | "taper" | "dyt",
    "taper_scope": "internal" | "all" | null,
    "gate": float in [0, 1] (null when not taper),
    "taper_c": {"blocks.0.ln_1": c, ...} (taper only; every TaperNorm layer).
A tied LM head is stored once (as wte.weight). Loading validates everything and
raises CheckpointError with one line naming the file and field.

    python -m models.checkpoint DIR      # validate and summarize a checkpoint
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from models.decoder import Decoder, DecoderConfig

FORMAT_VERSION = 1
CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"
DISABLED_NORM_EPS = 1e6  # eps this large turns a norm into a fixed scale (FakeLN-style)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message is one line meant for the user."""


def _read_config(path: Path) -> dict:
    try:
        text = (path / CONFIG).read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{path / CONFIG}: missing; a checkpoint directory needs {CONFIG}, {WEIGHTS} and {TOKENIZER}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / CONFIG}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix or re-save the checkpoint") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path / CONFIG}: expected a JSON object, found {type(raw).__name__}")
    return raw


def _validate_config(path: Path, raw: dict) -> DecoderConfig:
    where = path / CONFIG
    if raw.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: field 'format' is {raw.get('format')!r}; expected {FORMAT_VERSION}")
    try:
        cfg = DecoderConfig.from_dict(raw)
        cfg.validate()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: field {e}") from None
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
        raise CheckpointError(f"{where}: missing; a checkpoint directory needs {CONFIG}, {WEIGHTS} and {TOKENIZER}")
    try:
        tensors = load_file(str(where))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{where}: not a readable safetensors file ({e}); re-save the checkpoint") from None
    expected = _stored_state(model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where}: tensors disagree with config.json (missing {missing}, unexpected {unexpected})")
    for name, ref in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(f"{where}: tensor '{name}' has shape {list(t.shape)}; config.json implies {list(ref.shape)}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"{where}: tensor '{name}' contains NaN or Inf; the checkpoint is corrupt (retrain or restore it)")
    model.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()}, strict=False)


def load_checkpoint(path: str | os.PathLike) -> Decoder:
    """Validated model in eval mode, gate and per-layer c applied."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory (expected a folder with {CONFIG}, {WEIGHTS}, {TOKENIZER})")
    raw = _read_config(path)
    cfg = _validate_config(path, raw)
    if not (path / TOKENIZER).is_file():
        raise CheckpointError(f"{path / TOKENIZER}: missing; a checkpoint directory needs {CONFIG}, {WEIGHTS} and {TOKENIZER}")
    model = Decoder(cfg)
    _apply_taper_c(path / CONFIG, model, raw.get("taper_c"))
    if cfg.norm == "taper":
        model.set_gate(raw["gate"])
    _load_weights(path, model)
    return model.eval()


def load_tokenizer(path: str | os.PathLike):
    from tokenizers import Tokenizer
    where = Path(path) / TOKENIZER
    try:
        return Tokenizer.from_file(str(where))
    except Exception as e:  # tokenizers raises plain Exception on bad files
        raise CheckpointError(f"{where}: not a readable tokenizer.json ({str(e).splitlines()[0]})") from None


def checkpoint_config(model: Decoder) -> dict:
    cfg = model.cfg.to_dict()
    taper = model.cfg.norm == "taper"
    return {"format": FORMAT_VERSION, **cfg,
            "gate": model.gate.value if taper else None,
            "taper_c": model.taper_c() if taper else None}


def save_checkpoint(model: Decoder, path: str | os.PathLike, tokenizer_json: str | os.PathLike,
                    extra_files: dict[str, str | os.PathLike] | None = None) -> Path:
    """Write atomically: a temporary sibling directory renamed over `path`.

    tokenizer_json: path of a tokenizer.json to copy in; extra_files: name ->
    source path of further files to copy (e.g. the training log).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        (tmp / CONFIG).write_text(json.dumps(checkpoint_config(model), indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in _stored_state(model).items()}
        save_file(state, str(tmp / WEIGHTS))
        shutil.copyfile(tokenizer_json, tmp / TOKENIZER)
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def replace_dir(tmp: Path, path: Path) -> None:
    """Move a finished directory into place; the old one survives until the new one is there."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m models.checkpoint CHECKPOINT_DIR", file=sys.stderr)
        return 2
    try:
        model = load_checkpoint(argv[0])
        load_tokenizer(argv[0])
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    cfg = model.cfg
    gate = f", gate {model.gate.value}" if cfg.norm == "taper" else ""
    scope = f" ({cfg.taper_scope})" if cfg.taper_scope else ""
    print(f"{argv[0]}: ok: {cfg.norm}{scope}{gate}, {model.num_params():,} params, "
          f"d_model {cfg.d_model}, {cfg.n_layer} layers, {cfg.n_head} heads, vocab {cfg.vocab_size}, capacity {cfg.max_seq_len}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
