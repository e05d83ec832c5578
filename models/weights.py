"""A model's weights read one tensor at a time from memory-mapped files, never the whole model.

    source = open_weights(DIR)                 # our checkpoint or a Hugging Face folder
    source.cfg, source.skeleton                # the config; a Decoder on the meta device (gate, c set)
    block = source.block(3)                    # blocks.3 as an fp32 module, its weights read now
    source.tensor("wte.weight")                # one fp32 tensor, our name
    source.rows("wte.weight", 0, 1024)         # its rows [0, 1024) (our checkpoint: only those are read)

The build (export/emit.py's Lazy weights, written by export/pipeline.py) and the layer-by-layer
reference (models/layerwise.py) read models of every size through this: safetensors files are opened with safe_open (memory
mapped: a tensor is read when asked for), pytorch_model.bin with torch.load(mmap=True,
weights_only=True), both through models/hf_files.py. Hugging Face names and layouts are
mapped with the family's layout (models/convert.py's `hf_weight_plan`, models/hf_layout.py),
checked against the files' headers before any tensor is read (names, shapes, float dtypes),
and every tensor is checked finite as it is read. Peak memory is one block (plus the tensor
being converted), whatever the model's size.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from models.checkpoint import (CONFIG, WEIGHTS, CheckpointError, all_finite, apply_taper_state,
                               check_checkpoint_tokenizer, read_checkpoint_config)
from models.decoder import Block, Decoder, DecoderConfig


_STOPS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interruptible():
    """Around a read whose errors become "cannot be read": yields `interrupted()`, whether a Ctrl-C or SIGTERM
    came meanwhile; and a stop that came is raised (KeyboardInterrupt) at the end even when the read returned.

    The stop's KeyboardInterrupt can be lost inside the read: raised by the handler in the middle of C code,
    safetensors' get_tensor (torch building the tensor from its storage) answers it with a ValueError "could
    not determine the shape of object type 'torch.storage.UntypedStorage'", no trace of the interrupt left
    (found by sending SIGINT at random moments: 1 read in 5). Turned into a CheckpointError, that was a corrupt
    file and exit 1 for a Ctrl-C (issue 42; 3 of 6 tries during export.build's reads). So the handlers of
    both signals are wrapped for the read's duration to note the signal, then do what they did (raise
    KeyboardInterrupt). A signal that is ignored or left to its default action is left alone, and so is a
    read outside the main thread (where Python runs no handler)."""
    noted: list[int] = []
    wrapped = {}
    if threading.current_thread() is threading.main_thread():
        for sig in _STOPS:
            previous = signal.getsignal(sig)
            if callable(previous):
                def note(signum, frame, previous=previous):
                    noted.append(signum)
                    previous(signum, frame)
                wrapped[sig] = previous
                signal.signal(sig, note)
    try:
        yield lambda: bool(noted)
    finally:
        for sig, previous in wrapped.items():
            signal.signal(sig, previous)
    if noted:       # the read returned (or raised what was caught) with the interrupt lost inside it
        raise KeyboardInterrupt


@dataclass
class _Place:
    """Where one of our tensors comes from: a file's tensor, how to read it, the function that maps it."""
    file: Path
    name: str
    read: Callable[[], torch.Tensor]
    fn: Callable[[torch.Tensor], torch.Tensor]
    # rows [a, b) of dim 0 read alone (a safetensors slice of our own checkpoint, where fn is the identity);
    # None: the mapping may transpose or split the stored tensor, so rows are cut from the converted whole
    read_rows: Callable[[int, int], torch.Tensor] | None = None


class WeightSource:
    """Our-named fp32 tensors of one model, read on demand."""

    def __init__(self, where: Path, cfg: DecoderConfig, places: dict[str, _Place], raw_config: dict,
                 source: str, notes: list[str] | None = None):
        self.where, self.cfg, self.places, self.raw_config = where, cfg, places, raw_config
        self.source = source                    # "checkpoint" | "hf:<model_type>"
        self.notes = notes or []
        with torch.device("meta"):
            self.skeleton = Decoder(cfg)
        if source == "checkpoint":
            apply_taper_state(where / CONFIG, self.skeleton, raw_config)

    def tensor(self, name: str, own: bool = False) -> torch.Tensor:
        """Our tensor `name` (e.g. blocks.0.attn.q_proj.weight) in fp32, checked float and finite. `own`: one
        that shares no memory with the stored tensor (copied where that is fp32 already), which may be changed."""
        place = self.places[name]
        return self._checked(place, place.read, own)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of our tensor `name`, fp32, checked as tensor() checks it. From our
        checkpoint only those rows are read (safetensors slice of the memory-mapped file); from a Hugging
        Face folder the tensor is converted whole (one tensor, never the model) and cut."""
        place = self.places[name]
        if place.read_rows is None:
            return self.tensor(name)[start:stop].clone()
        return self._checked(place, lambda: place.read_rows(start, stop))

    @staticmethod
    def _checked(place: _Place, read: Callable[[], torch.Tensor], own: bool = False) -> torch.Tensor:
        """read()'s raw tensor through place.fn, fp32; CheckpointError for unreadable, non-float or non-finite.
        A Ctrl-C or SIGTERM during the read is the interrupt it is, never "cannot be read" (interruptible)."""
        with interruptible() as interrupted:
            try:
                raw = read()
            except Exception as e:      # a file damaged past its header
                if interrupted():
                    raise KeyboardInterrupt from None
                from core.errors import first_line
                raise CheckpointError(f"{place.file}: tensor {place.name!r} cannot be read ({first_line(e)}); "
                                      "re-save the weights") from None
        if not raw.is_floating_point():
            raise CheckpointError(f"{place.file}: tensor {place.name!r} has dtype {str(raw.dtype).replace('torch.', '')}; "
                                  "expected floating-point weights")
        t = place.fn(raw.to(torch.float32)).contiguous()
        if own and t.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
            t = t.clone()                       # (a bf16 or fp16 one was converted: already a tensor of its own)
        if not all_finite(t):
            raise CheckpointError(f"{place.file}: tensor {place.name!r} contains NaN or Inf; the weights are corrupt")
        return t

    def fill(self, module: nn.Module, prefix: str) -> nn.Module:
        """Give the meta-device `module` (our names under `prefix`) its weights, fp32 on the CPU."""
        module = module.to_empty(device="cpu")      # (its buffers; the parameters' untouched pages are let go below)
        for name, p in module.named_parameters():
            t = self.tensor(prefix + name, own=True)    # converted from bf16 already: taken, not copied again
            if t.shape != p.shape:
                raise CheckpointError(f"{self.where}: tensor {prefix + name!r} has shape {list(t.shape)}, "
                                      f"expected {list(p.shape)}; re-save the weights")
            p.data = t
        return module

    def block(self, i: int) -> Block:
        """blocks.i with its weights (a fresh module each call; the skeleton stays on meta)."""
        import copy
        # deepcopy keeps what is not a tensor: TaperNorm's c and its gate's value
        return self.fill(copy.deepcopy(self.skeleton.blocks[i]), f"blocks.{i}.").eval()

    def weight_bytes(self) -> int:
        """fp32 bytes of the model's parameters (a tied table once)."""
        return 4 * sum(p.numel() for p in {id(p): p for p in self.skeleton.parameters()}.values())


def _checkpoint_source(path: Path, max_seq_len: int | None) -> WeightSource:
    raw, cfg = read_checkpoint_config(path, memory_check=False)
    check_checkpoint_tokenizer(path, raw, cfg)        # as load_checkpoint: ids past the vocabulary crash generation
    where = path / WEIGHTS
    if not where.is_file():
        raise CheckpointError(f"{where}: missing; a checkpoint directory holds {WEIGHTS}")
    from models.hf_files import read_safetensor, read_safetensor_rows, safetensors_shapes
    with interruptible() as interrupted:
        try:
            shapes = safetensors_shapes(where)
        except Exception as e:  # safetensors raises several types on a damaged header
            if interrupted():
                raise KeyboardInterrupt from None
            from core.errors import first_line
            raise CheckpointError(f"{where}: not a readable safetensors file ({first_line(e)}); "
                                  "re-save the checkpoint") from None
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Decoder(cfg).state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where}: tensors disagree with config.json (missing {missing[:3]}, unexpected {unexpected[:3]})")
    for k, shape in expected.items():
        if shapes[k] != shape:
            raise CheckpointError(f"{where}: tensor '{k}' has shape {list(shapes[k])}; config.json implies {list(shape)}")
    places = {k: _Place(where, k, lambda k=k: read_safetensor(where, k), lambda t: t,
                        lambda a, b, k=k: read_safetensor_rows(where, k, a, b)) for k in expected}
    if cfg.tie_embeddings:
        places["lm_head.weight"] = places["wte.weight"]
    notes = []
    if max_seq_len is not None and max_seq_len != cfg.max_seq_len:
        cfg, note = _with_capacity(path, cfg, max_seq_len, places)
        notes += [note] if note else []
    return WeightSource(path, cfg, places, raw, "checkpoint", notes)


def _with_capacity(path: Path, cfg: DecoderConfig, capacity: int, places: dict) -> tuple[DecoderConfig, str]:
    """cfg with KV-cache capacity `capacity` instead of the checkpoint's (and a note, or ""). A learned
    position table has a row per position: a smaller capacity reads its first rows (the cache and the
    table are the same S_max), a larger one has no rows to read and is refused. Rotary positions are
    computed, so a rope model may be built past the capacity it was saved with (said in the note: the
    checkpoint does not record how far its model was trained)."""
    import dataclasses
    saved = cfg.max_seq_len
    if cfg.pos_embedding == "learned":
        if capacity > saved:
            raise CheckpointError(f"--max-seq-len {capacity}: expected at most {saved} ({path} has learned positions, "
                                  f"a table of {saved} rows), found {capacity}; pass --max-seq-len {saved} or less")
        wpe = places["wpe.weight"]
        places["wpe.weight"] = _Place(wpe.file, wpe.name, wpe.read, lambda t: t[:capacity],
                                      lambda a, b: wpe.read_rows(a, min(b, capacity)))
    note = (f"capacity {capacity} tokens, past the {saved} {path} was saved with: rotary positions extend, but "
            "check the model was trained that long" if capacity > saved else "")
    return dataclasses.replace(cfg, max_seq_len=capacity), note


def _hf_source(path: Path, max_seq_len: int | None) -> WeightSource:
    from models.convert import hf_weight_plan
    plan = hf_weight_plan(path, max_seq_len)
    # a refusal names the tensor as the folder's file spells it (plan.names), not by our name
    places = {ours: _Place(stored.file, plan.names.get(ours, ours), stored.read, fn)
              for ours, (stored, fn) in plan.places.items()}
    return WeightSource(path, plan.cfg, places, plan.raw, f"hf:{plan.raw['model_type']}", plan.notes)


def model_weights(model: Decoder) -> WeightSource:
    """A Decoder held in memory as a WeightSource (small builds, bench, tests): its tensors as they are, its
    gate and every TaperNorm's c on the skeleton."""
    where = Path("(in memory)")
    places = {k: _Place(where, k, lambda t=t: t.detach(), lambda t: t)
              for k, t in model.named_parameters(remove_duplicate=False)}
    source = WeightSource(where, model.cfg, places, {}, "in-memory")
    if model.cfg.norm == "taper":
        source.skeleton.set_gate(model.gate.value)
        for name, layer in source.skeleton.taper_layers().items():
            layer.c = model.get_submodule(name).c
    return source


def open_weights(path: str | os.PathLike, max_seq_len: int | None = None) -> WeightSource:
    """The weights of our checkpoint or of a Hugging Face folder, to be read tensor by tensor."""
    from models.convert import is_hf_folder
    path = Path(path)
    return _hf_source(path, max_seq_len) if is_hf_folder(path) else _checkpoint_source(path, max_seq_len)
