"""A Hugging Face folder's weight files, read by tensor name without reading the model whole.

    stored = read_weights(HF_DIR)            # name -> Stored (file, shape from the header, read())
    t = stored["model.embed_tokens.weight"].read()

The files are those transformers prefers, in its order (`weight_files`): model.safetensors,
sharded safetensors with model.safetensors.index.json, pytorch_model.bin, or sharded .bin with
pytorch_model.bin.index.json. A safetensors file is memory-mapped and each tensor read when
asked for; a pytorch_model.bin is read weights-only (torch.load(weights_only=True), mmap where
its format allows), and a pickle that would call code is refused naming what it calls, found
with pickletools without running anything. Every problem is one ConvertError line naming the
file. models/convert.py maps the tensors to ours; models/weights.py reads our own checkpoint's
safetensors with the same readers.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import re
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from core.errors import first_line
from models.checkpoint import CheckpointError

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_BIN, TORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
WEIGHT_FILES = f"{SAFETENSORS}, {SAFETENSORS_INDEX} with its shards, {TORCH_BIN} or {TORCH_BIN_INDEX} with its shards"


class ConvertError(CheckpointError):
    """A Hugging Face folder that cannot be converted; one line naming the file and what is wrong."""


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


def unreadable(where: Path, reason: str) -> ConvertError:
    """A weights file damaged past what its reader accepts (models/convert.py also says it of a tensor's data)."""
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
    return unreadable(where, reason)


def safetensors_shapes(where: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from a safetensors file's header (no data read); the reader's own error if damaged."""
    from safetensors import safe_open
    with safe_open(str(where), framework="pt") as handle:
        return {n: tuple(handle.get_slice(n).get_shape()) for n in handle.keys()}


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
            shapes = safetensors_shapes(where)
            # opened again for each read: a handle kept open keeps every page it read mapped (resident)
            return {n: Stored(where, shape, lambda n=n: read_safetensor(where, n)) for n, shape in shapes.items()}
        with warnings.catch_warnings():     # a damaged pickle warns before it fails: one line only
            warnings.simplefilter("ignore")
            # memory-mapped where the format allows it (zip, torch >= 1.6): shapes now, data when used
            state = torch.load(where, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(where))
    except pickle.UnpicklingError as e:
        raise _pickle_refused(where, e) from None
    except Exception as e:  # safetensors, pickle and zip readers raise many types on a damaged file
        raise unreadable(where, first_line(e)) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConvertError(f"{where}: expected a state dict of tensors, found {type(state).__name__}; re-save the folder")
    return {n: Stored(where, tuple(t.shape), lambda t=t: t) for n, t in state.items()}


def read_weights(path: Path) -> dict[str, Stored]:
    """Every tensor of the folder by name (shapes only: nothing is read yet)."""
    out: dict[str, Stored] = {}
    for f in weight_files(path):
        out.update(_read_file(f))
    return out
