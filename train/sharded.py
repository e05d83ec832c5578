"""Sharded data parallel (FSDP2, torch.distributed.fsdp.fully_shard) for train/loop.py's --fsdp.

    model = sharded_initial_model(recipe, run, device, fresh)   # meta, fully_shard, then each rank's rows only
    save_sharded_state(tmp / SHARDED_STATE, model, opt)       # every rank writes its shards
    load_sharded_state(run_dir / SHARDED_STATE, model, opt)   # any number of ranks (or one, no group)
    write_streamed_weights(path_or_None, model, recipe, par)  # one model.safetensors, tensor by tensor

Each rank keeps 1/N of every parameter (a DTensor sharded on dim 0), of its gradient and of
AdamW's two moments (the optimizer is built on the sharded parameters, so its state is sharded
with them). A group's parameters are all-gathered for its forward and again for its backward
(reshard_after_forward: the root too, so that no full copy lingers after an evaluation and
code between steps, calibration's copy of gamma into gamma_tilde, sees the sharded
parameters the optimizer holds); gradients are reduce-scattered as the mean over ranks, as
DDP's all-reduce is. Buffers (FakeLN's frozen std) are not sharded: every rank sets the same
value from all-reduced sums.

Building (sharded_initial_model): no rank ever holds the whole model. The recipe's model is built with
its weight matrices on the meta device (vectors and buffers, O(n_layer x d), as always), sharded, and
only then materialized (to_empty) as this rank's shards, which are filled row range by row range: read
from the source checkpoint's memory-mapped safetensors (a fresh fine-tune), drawn by replaying the
random init one module at a time (a fresh `train`: the same weights and generator state as one
process), or left to dcp.load (--resume).

Without a process group (one process, e.g. `--resume` of a two-rank run with plain python)
nothing is sharded: the same resume state and checkpoint code run on plain tensors.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import struct
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from core.outputs import writing
from models.decoder import Decoder
from train.errors import TrainError

SHARDED_STATE = "train_state.dcp"       # torch.distributed.checkpoint folder: model and optimizer, by FQN
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if is_sharded(t) else t


def checkpoint_blocks(model: Decoder) -> None:
    """Recompute each block's activations in backward instead of keeping them (--checkpoint-activations):
    only the block inputs stay alive between forward and backward. The block's own forward is wrapped
    (its names and state dict do not change); under FSDP the recompute runs while the block's
    parameters are all-gathered for its backward."""
    from torch.utils.checkpoint import checkpoint
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def mixed_precision(dtype: str):
    """--dtype bf16: bf16 parameters in compute (all-gathered in bf16), fp32 sharded master weights and
    fp32 gradient reduce-scatter; fp32: none."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(model: Decoder, device: torch.device, dtype: str) -> nn.Module:
    """fully_shard every block, the embedding and the head (their own groups when untied), then the root
    (wpe, ln_f, and a tied wte / lm_head: one parameter may sit in one group only). Needs a process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kw = dict(mesh=mesh, mp_policy=mixed_precision(dtype), reshard_after_forward=True)
    for block in model.blocks:
        fully_shard(block, **kw)
    if not model.cfg.tie_embeddings:
        fully_shard(model.wte, **kw)
        fully_shard(model.lm_head, **kw)
    return fully_shard(model, **kw)


# --- building the sharded model: meta device, then each rank's rows ------------------------------------

@contextlib.contextmanager
def matrices_on_meta():
    """Modules built inside get every parameter of two or more dims (the weight matrices: all of the model
    but O(n_layer x d)) on the meta device, as it is registered: no memory and no values. Vectors (norm
    gains, biases) and buffers (rope tables, FakeLN's std) keep the values their constructors compute,
    which the sharded model gets back after to_empty (there is no other copy of how they are made)."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.dim() >= 2 and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)
    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def shard_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [start, stop) of dim 0 that rank `rank` holds of a Shard(0) tensor of n rows: FSDP2 splits as
    torch.chunk does, ceil(n / world) rows a rank, the last ranks short or empty."""
    per = -(-n // world)
    return min(n, rank * per), min(n, (rank + 1) * per)


def meta_model(recipe, run) -> tuple[Decoder, dict, dict]:
    """(the recipe's model with its matrices on meta, its vectors by name, its buffers by name)."""
    # fork_rng: the constructors' random init (on meta: no values) must not move the generator; a fresh
    # run's draws are replayed afterwards from the state one process would have (replay_init)
    with torch.random.fork_rng(devices=[]), matrices_on_meta():
        model = recipe.initial_model(run, fresh=False)
    vectors = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return model, vectors, buffers


def shard_targets(model: nn.Module, rank: int, world: int) -> dict[str, tuple[torch.Tensor, int]]:
    """{parameter name: (this rank's local shard, the row of the whole tensor it starts at)}; a tied
    parameter once, under its first name."""
    targets = {}
    for name, p in model.named_parameters():
        local = local_part(p)
        if local.dim() == 0:
            targets[name] = (local, 0)
            continue
        start, stop = shard_rows(p.shape[0], rank, world) if is_sharded(p) else (0, p.shape[0])
        if local.shape[0] != stop - start:   # FSDP2 changed how it splits: filling would misplace rows
            raise RuntimeError(f"{name}: local shard of {local.shape[0]} rows, expected rows [{start}, {stop})")
        targets[name] = (local, start)
    return targets


def _rows_of(full: torch.Tensor, local: torch.Tensor, start: int) -> torch.Tensor:
    return full if local.dim() == 0 else full[start:start + local.shape[0]]


@torch.no_grad()
def fill_shards(targets: dict, vectors: dict, source=None) -> None:
    """Each target's rows from `source` (a models.weights.WeightSource: only those rows are read) where it
    has the tensor, else the vector as built; matrices nobody gives (a resume: dcp.load fills them next)
    are zeroed."""
    for name, (local, start) in targets.items():
        if source is not None and name in source.places:
            local.copy_(source.rows(name, start, start + local.shape[0]) if local.dim() else source.tensor(name))
        elif name in vectors:
            local.copy_(_rows_of(vectors[name], local, start))
        elif source is not None:
            raise TrainError(f"{source.where}: has no tensor {name!r}, which the model being fine-tuned needs; "
                             "start from a checkpoint of the same architecture")
        else:
            local.zero_()


@torch.no_grad()
def replay_init(skeleton: Decoder, targets: dict, draws: list) -> None:
    """The random init one process makes (Decoder's constructors, then init_module_weights over every
    module, then the recipe's own draws), replayed one module at a time on a whole CPU copy of that module
    alone, in the same order and shapes, so the generator yields the same numbers: each rank keeps its
    rows. At most one module's weights are whole at once, never the model."""
    modules = [(prefix, m) for prefix, m in skeleton.named_modules() if any(True for _ in m.parameters(recurse=False))]
    for _, m in modules:       # what the constructors drew (nn.Linear / nn.Embedding call reset_parameters)
        if hasattr(m, "reset_parameters"):
            copy.deepcopy(m).to_empty(device="cpu").reset_parameters()
    for prefix, m in modules:
        whole = copy.deepcopy(m).to_empty(device="cpu")
        for name, p in whole.named_parameters(recurse=False):
            if p.dim() >= 2:
                p.fill_(float("nan"))      # a matrix the replay does not draw must not pass unnoticed
        Decoder.init_module_weights(whole)
        for name, p in whole.named_parameters(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            if key in targets and p.dim() >= 2:      # vectors: as built; a tied head: drawn, then dropped
                if torch.isnan(p).any():
                    raise RuntimeError(f"{key}: its random init cannot be replayed module by module")
                local, start = targets[key]
                local.copy_(_rows_of(p, local, start))
    for key, draw in draws:
        whole = torch.empty(skeleton.get_parameter(key).shape)
        draw(whole)
        local, start = targets[key]
        local.copy_(_rows_of(whole, local, start))


def sharded_initial_model(recipe, run, device: torch.device, fresh: bool) -> nn.Module:
    """The recipe's model, fully_shard-ed, no rank holding it whole at any point (see the module's doc):
    fresh from recipe.source_weights(run) when it names one (read row range by row range), else drawn
    as one process draws it (replay_init); not fresh (a resume): zeros, for dcp.load to fill."""
    model, vectors, buffers = meta_model(recipe, run)
    source = recipe.source_weights(run) if fresh else None
    skeleton = copy.deepcopy(model) if fresh and source is None else None
    model.to_empty(device="meta")        # the vectors too: one device for fully_shard; they are kept above
    if run.checkpoint_activations:
        checkpoint_blocks(model)
    model = shard_model(model, device, run.dtype)
    model.to_empty(device=device)        # this rank's shards only, uninitialized
    targets = shard_targets(model, dist.get_rank(), dist.get_world_size())
    fill_shards(targets, vectors, source)
    if skeleton is not None:
        replay_init(skeleton, targets, recipe.init_draws(run))
    with torch.no_grad():
        for name, b in buffers.items():
            model.get_buffer(name).copy_(b)
    return model


# --- the resume state: torch.distributed.checkpoint ----------------------------------------------

def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Model and optimizer state by parameter name (FQN), sharded where the model is: the same keys
    for any number of ranks, so DCP reshards on load."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, opt_state = get_state_dict(model, opt)
    return {"model": model_state, "optimizer": opt_state}


def save_sharded_state(directory: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Every rank writes its shards into `directory` (a path all ranks see: inside the temporary run
    folder rank 0 commits afterwards, so a stopped save leaves the previous checkpoint whole)."""
    import torch.distributed.checkpoint as dcp
    # a failed write is raised on every rank (dcp gathers the ranks' results), naming no file
    with warnings.catch_warnings(), writing(directory):   # one process (no process group) writes the same format
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(_state(model, opt), checkpoint_id=str(directory), no_dist=not dist.is_initialized())


# What the .metadata of torch.distributed.checkpoint names (torch 2.13): its own dataclasses and enums,
# torch's Size, dtypes and layouts, and the checkpoint id's path. Anything else is refused unread.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_CALLABLES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                       ("collections", "OrderedDict")}


def metadata_allows(module: str, name: str) -> bool:
    """Whether the .metadata pickle may call module.name: a data class of torch.distributed.checkpoint
    (constructing one runs nothing of the file's), a torch dtype, or one of _METADATA_CALLABLES."""
    import dataclasses
    import enum
    import sys
    if module in _METADATA_MODULES:
        obj = getattr(sys.modules.get(module), name, None)         # imported already by dcp itself
        return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    if module == "torch" and name != "Size":
        return isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in _METADATA_CALLABLES


def read_sharded_metadata(directory: Path):
    """The checkpoint's Metadata, read without running code (core.inputs.load_restricted_pickle):
    torch.distributed.checkpoint's own reader unpickles `.metadata` with pickle.load, and a crafted
    file's payload ran on --resume."""
    from torch.distributed.checkpoint.metadata import Metadata
    from core.inputs import load_restricted_pickle
    path = Path(directory) / ".metadata"
    fix = "restore the run folder from a copy you trust, or start a new run in another --out"
    md = load_restricted_pickle(path, "the metadata of a sharded resume state (torch.distributed.checkpoint)",
                                metadata_allows, fix)
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise TrainError(f"{path}: expected the metadata of a sharded resume state, found a {type(md).__name__}; {fix}")
    return md


def _checkpoint_reader(directory: Path, metadata):
    """dcp's FileSystemReader, given the metadata read_sharded_metadata read, and a load planner that reads
    the non-tensor items (the optimizer's settings) with torch's weights-only unpickler: dcp's own
    DefaultLoadPlanner unpickles them with weights_only=False, code in the .distcp file would run."""
    import io
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            import pickle
            try:
                data = pickle_of_data(value)
            except pickle.UnpicklingError as e:      # its message: advice around the reader's own reason
                reason = next((ln.strip() for ln in str(e).splitlines() if ln.strip() and "weights_only" not in ln
                               and not ln.startswith(("Weights only load failed", "Check the documentation"))),
                              "damaged")
                reason = reason.split(". ")[0].rstrip(".")
                raise RuntimeError(f"item {read_item.dest_index.fqn} refused by torch's weights-only reader: "
                                   f"{reason}, and loading it fully could run code") from None
            super().load_bytes(read_item, io.BytesIO(data))

    return Reader(str(directory)), Planner()


def pickle_of_data(value) -> bytes:
    """The bytes of a pickle torch's weights-only unpickler reads (plain data and tensors), re-pickled for
    a caller that unpickles them fully; anything else raises pickle.UnpicklingError."""
    import io
    buf = io.BytesIO()
    with warnings.catch_warnings():          # dcp pickles with protocol 4, which the reader reads
        warnings.filterwarnings("ignore", "Detected pickle protocol")
        torch.save(torch.load(value, map_location="cpu", weights_only=True), buf)
    return buf.getvalue()


def load_sharded_state(directory: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Load the state save_sharded_state wrote, with any number of ranks: each reads the parts of the
    saved shards its own shards cover (one process without a process group reads them all). Nothing
    of the folder's is run (read_sharded_metadata, _checkpoint_reader); a folder dcp cannot load (damaged,
    truncated, another model's) is one TrainError line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    metadata = read_sharded_metadata(directory)
    state = _state(model, opt)
    # A parameter that had no gradient yet has no optimizer state in the folder (gamma_tilde before
    # calibration), while a fresh optimizer's state dict has one for every parameter: leave those out,
    # so the parameter starts without state, as in the run that saved it.
    for name, per_param in list(state["optimizer"]["state"].items()):
        if not any(f"optimizer.state.{name}.{k}" in metadata.state_dict_metadata for k in per_param):
            del state["optimizer"]["state"][name]
    reader, planner = _checkpoint_reader(directory, metadata)
    try:
        with warnings.catch_warnings():          # one process reading a sharded run is intended, not a mistake
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=not dist.is_initialized())
    except CheckpointException as e:        # (a BaseException, with every rank's traceback in its text)
        reason = first_line_of(next(iter(e.failures.values()), e)).split(". ")[0][:200]
        raise TrainError(f"{directory}: expected the sharded resume state of the run's own model, found one that "
                         f"torch.distributed.checkpoint cannot load ({reason}); restore the run folder from a copy "
                         "you trust, or start a new run in another --out") from None
    # strict=False: the parameters left out above (dcp.load has checked that the folder holds every other key)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(strict=False))


def first_line_of(failure) -> str:
    """The message of a rank's failure in a CheckpointException (a WRAPPED_EXCEPTION: the exception and its
    traceback), else the first line of its text."""
    exc = failure[0] if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException) else failure
    text = str(exc)
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)


def sharded_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its shards only)."""
    return sum(local_part(v).numel() * local_part(v).element_size()
               for per_param in opt.state.values() for v in per_param.values() if torch.is_tensor(v))


# --- the consolidated checkpoint, streamed ---------------------------------------------------------

def saved_tensor_names(model: nn.Module, recipe) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor as the model holds it) of what the checkpoint stores, in state-dict order; a tied
    head is stored once (as wte.weight), as models/checkpoint.py does."""
    names = []
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.cfg.tie_embeddings:
            continue
        if recipe.stores(name):
            names.append((name, t))
    return names


def _header(entries: list[tuple[str, torch.dtype, tuple]]) -> bytes:
    """safetensors header: {name: dtype, shape, data_offsets} in file order, padded to 8 bytes."""
    meta, offset = {}, 0
    for name, dtype, shape in entries:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        meta[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_streamed_weights(path: Path | None, model: nn.Module, recipe) -> None:
    """The model's consolidated weights as one safetensors file at `path` (rank 0; None on the others),
    gathered one tensor at a time: every rank takes part in each tensor's all-gather (full_tensor), and
    rank 0 writes it and lets it go, so no rank ever holds the whole model twice. The recipe may
    transform each tensor (FakeLN: gamma * 1e6 / std) or leave it out (its std buffers). A write that
    fails (a full disk) is raised after the last gather: the other ranks are waiting in it."""
    items = saved_tensor_names(model, recipe)
    # the header needs every shape and dtype first: the global ones, known without gathering
    entries = [(name, torch.float32 if t.is_floating_point() else t.dtype, tuple(t.shape)) for name, t in items]
    f = open(path, "wb") if path is not None else None
    failed = None

    def write(data: bytes) -> None:
        nonlocal failed
        try:
            f.write(data)
        except OSError as e:
            failed = e
    try:
        if f is not None:
            write(_header(entries))
        for name, t in items:
            full = t.full_tensor() if is_sharded(t) else t        # a collective: every rank, same order
            if f is None or failed is not None:
                continue
            out = recipe.saved_tensor(model, name, full.detach().to("cpu", torch.float32))
            write(out.contiguous().numpy().tobytes())
            del full, out
    finally:
        if f is not None:
            with writing(path):
                f.close()
    if failed is not None:
        raise OSError(failed.errno, failed.strerror, str(path)) from failed


def all_finite(model: nn.Module, par) -> bool:
    """Whether every weight of every rank's shard is finite (the same answer on every rank)."""
    bad = any(not bool(torch.isfinite(local_part(p)).all()) for p in model.parameters())
    return par.max(float(bad)) == 0.0
