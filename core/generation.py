"""The model's stop tokens, carried from its Hugging Face folder into the checkpoint, the build and the
Triton repository as one file, GENERATION (generation.json):

    {"eos_token_ids": [151645, 151643]}

Why: a chat model ends its turn with its own token (Qwen3 <|im_end|>, Llama 3 <|eot_id|>, Gemma
<end_of_turn>), not <|endoftext|>; without these ids runtime.generate, the Triton generate model and the
OpenAI API would run on past the end of the turn to max_tokens. transformers' generate stops at the
generation config's eos_token_id (generation_config.json, else config.json: an int or a list); the
tokenizer's eos_token (tokenizer_config.json, else special_tokens_map.json, mapped to its id in
tokenizer.json) is added, as serving stacks do, so that a folder whose generation config names only
<|endoftext|> still stops at the end of a turn.

The file travels beside chat_template.json (core/chat_template.py) by the same one call,
write_model_files, at every step (models.convert, export.build, runtime.triton repo). Where a folder
has neither (our own trained models), there is no file and the default stays <|endoftext|>
(runtime.generate.default_stop_tokens). Torch-free: this module only reads JSON.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from core.chat_template import (CHAT_TEMPLATE, HF_SPECIAL_TOKENS_MAP, HF_TOKENIZER_CONFIG, ChatTemplateError,
                                read_json, token_text, write_chat_template)

GENERATION = "generation.json"
HF_GENERATION_CONFIG = "generation_config.json"
HF_CONFIG = "config.json"
TOKENIZER_JSON = "tokenizer.json"
# the files write_model_files carries from folder to folder (each where the source has it)
MODEL_FILES = (CHAT_TEMPLATE, GENERATION)


class GenerationFileError(ChatTemplateError):
    """A generation file that cannot be read; the message names the file and the fix."""


def _ids(value, where: Path, key: str) -> list[int]:
    """eos_token_id as Hugging Face writes it: an int, a list of ints, or null."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise GenerationFileError(f"{where}: {key}: expected a token id or a list of them, found {value!r}; fix the file")
    return list(values)


def _token_id(folder: Path, text: str) -> int | None:
    """The id of the token `text` in folder/tokenizer.json (its added tokens, then its vocabulary)."""
    path = folder / TOKENIZER_JSON
    if not path.is_file():
        return None
    data = read_json(path)
    for t in data.get("added_tokens") or ():
        if isinstance(t, dict) and t.get("content") == text and isinstance(t.get("id"), int):
            return t["id"]
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(text), int):
        return vocab[text]
    if isinstance(vocab, list):          # Unigram: [[piece, score], ...], the id is the index
        for i, entry in enumerate(vocab):
            if isinstance(entry, list) and entry and entry[0] == text:
                return i
    return None


def read_stop_tokens(folder: str | os.PathLike) -> list[int] | None:
    """The stop token ids of a Hugging Face folder, a checkpoint or a build (one that carries GENERATION),
    in order, without repeats; None where it names none."""
    folder = Path(folder)
    if (folder / GENERATION).is_file():
        ids = _ids(read_json(folder / GENERATION).get("eos_token_ids"), folder / GENERATION, "eos_token_ids")
        return ids or None
    ids: list[int] = []
    if (folder / HF_GENERATION_CONFIG).is_file():
        ids = _ids(read_json(folder / HF_GENERATION_CONFIG).get("eos_token_id"), folder / HF_GENERATION_CONFIG,
                   "eos_token_id")
    elif (folder / HF_CONFIG).is_file():
        config = read_json(folder / HF_CONFIG)
        if "model_type" in config and "format" not in config:      # a Hugging Face config, not a checkpoint's
            ids = _ids(config.get("eos_token_id"), folder / HF_CONFIG, "eos_token_id")
    tokens = read_json(folder / HF_SPECIAL_TOKENS_MAP) if (folder / HF_SPECIAL_TOKENS_MAP).is_file() else {}
    if (folder / HF_TOKENIZER_CONFIG).is_file():
        config = read_json(folder / HF_TOKENIZER_CONFIG)
        if "eos_token" in config:
            tokens["eos_token"] = config["eos_token"]              # tokenizer_config wins
    eos = token_text(tokens.get("eos_token"))
    if eos is not None and (i := _token_id(folder, eos)) is not None:
        ids.append(i)
    ids = list(dict.fromkeys(ids))
    return ids or None


def write_generation(source: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Write folder/GENERATION from the stop tokens `source` has; False (nothing written) where it has none."""
    ids = read_stop_tokens(source)
    if ids is None:
        return False
    (Path(folder) / GENERATION).write_text(json.dumps({"eos_token_ids": ids}) + "\n", encoding="utf-8")
    return True


def write_model_files(source: str | os.PathLike, folder: str | os.PathLike) -> list[str]:
    """Carry the chat template and the stop tokens (MODEL_FILES) of `source` into `folder`: the one call
    models.convert and export.build make. Returns the names written."""
    written = [CHAT_TEMPLATE] if write_chat_template(source, folder) else []
    return written + ([GENERATION] if write_generation(source, folder) else [])
