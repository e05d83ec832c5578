"""The model's chat template, carried from its Hugging Face folder into the checkpoint, the build and
the Triton repository as one file, CHAT_TEMPLATE (chat_template.json):

    {"chat_template": "{% for message in messages %}...", "bos_token": "<s>", "eos_token": "</s>", ...}

Where a Hugging Face folder keeps it (as transformers reads it, newest first): chat_template.jinja (the
template as text), else tokenizer_config.json's "chat_template" (a string, or a list of {"name",
"template"} of which "default" is the one apply_chat_template uses). The special tokens the template
may name (bos_token, eos_token, ...) come from tokenizer_config.json (a string or an AddedToken's
{"content": ...}), else special_tokens_map.json: transformers passes them to the template as
variables, so a Llama-3 or Gemma template renders its BOS only with them.

One file, not two: the template and its tokens travel together through every folder (models.convert,
export.build, runtime.triton repo), and runtime.openai renders from it (runtime/openai/chat_template.py).
Torch- and jinja-free: this module only finds and copies.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from core.errors import UserError

CHAT_TEMPLATE = "chat_template.json"
HF_TEMPLATE_FILE = "chat_template.jinja"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# the special tokens transformers' apply_chat_template passes to a template (its special_tokens_map)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(UserError):
    """A chat template file that cannot be read; the message names the file and the fix."""


def read_json(path: Path) -> dict:
    """A JSON object from a model folder's file (tokenizer_config.json, generation_config.json, ...), or one
    ChatTemplateError line naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ChatTemplateError(f"{path}: expected a JSON object, found an unreadable file ({e}); fix or remove it") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path}: expected a JSON object, found {type(data).__name__}; fix or remove it")
    return data


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json holds it: "<s>" or {"content": "<s>", ...} (an AddedToken)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(value, where: Path) -> str:
    """tokenizer_config.json's chat_template: a string, or named templates of which "default" is used."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatTemplateError(f"{where}: chat_template: expected a string or a template named 'default', found "
                                f"the names {sorted(map(str, named))}; pass one with --chat-template FILE")
    raise ChatTemplateError(f"{where}: chat_template: expected a string, found {type(value).__name__}; fix the file")


def read_hf_chat_template(folder: str | os.PathLike) -> dict | None:
    """{"chat_template": ..., "<special>_token": ...} of a Hugging Face folder, a checkpoint or a build
    (one that carries CHAT_TEMPLATE); None where it has no template."""
    folder = Path(folder)
    if (folder / CHAT_TEMPLATE).is_file():
        data = read_json(folder / CHAT_TEMPLATE)
        if not isinstance(data.get("chat_template"), str):
            raise ChatTemplateError(f"{folder / CHAT_TEMPLATE}: expected a string under \"chat_template\", found "
                                    f"{type(data.get('chat_template')).__name__}; fix or remove the file")
        return data
    config = read_json(folder / HF_TOKENIZER_CONFIG) if (folder / HF_TOKENIZER_CONFIG).is_file() else {}
    if (folder / HF_TEMPLATE_FILE).is_file():
        try:
            template = (folder / HF_TEMPLATE_FILE).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"{folder / HF_TEMPLATE_FILE}: expected UTF-8 text, found an unreadable file "
                                    f"({e}); fix or remove it") from None
    elif config.get("chat_template") is not None:
        template = _pick_template(config["chat_template"], folder / HF_TOKENIZER_CONFIG)
    else:
        return None
    tokens = read_json(folder / HF_SPECIAL_TOKENS_MAP) if (folder / HF_SPECIAL_TOKENS_MAP).is_file() else {}
    tokens.update({k: v for k, v in config.items() if k in SPECIAL_TOKENS})      # tokenizer_config wins
    special = {k: t for k in SPECIAL_TOKENS if (t := token_text(tokens.get(k))) is not None}
    return {"chat_template": template, **special}


def write_chat_template(source: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Write folder/CHAT_TEMPLATE from the template `source` (a folder read_hf_chat_template reads) has;
    False (nothing written) where it has none."""
    data = read_hf_chat_template(source)
    if data is None:
        return False
    (Path(folder) / CHAT_TEMPLATE).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return True


def load_chat_template(path: str | os.PathLike) -> dict:
    """A template given by the user (--chat-template FILE): a Jinja text file, a JSON file in CHAT_TEMPLATE's
    shape or a tokenizer_config.json, or a folder read_hf_chat_template reads."""
    path = Path(path)
    if path.is_dir():
        data = read_hf_chat_template(path)
        if data is None:
            raise ChatTemplateError(f"--chat-template {path}: expected a folder with {HF_TEMPLATE_FILE}, "
                                    f"{HF_TOKENIZER_CONFIG} (chat_template) or {CHAT_TEMPLATE}, found none; "
                                    "pass the template file")
        return data
    if not path.is_file():
        raise ChatTemplateError(f"--chat-template {path}: expected a template file, found nothing; check the path")
    if path.suffix == ".json":
        data = read_json(path)
        if "chat_template" not in data:
            raise ChatTemplateError(f"--chat-template {path}: expected a \"chat_template\" key, found none; pass "
                                    "the template itself (a .jinja file) or a tokenizer_config.json with one")
        special = {k: t for k in SPECIAL_TOKENS if (t := token_text(data.get(k))) is not None}
        return {"chat_template": _pick_template(data["chat_template"], path), **special}
    try:
        return {"chat_template": path.read_text(encoding="utf-8")}
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"--chat-template {path}: expected UTF-8 text, found an unreadable file ({e}); "
                                "pass the template file") from None
