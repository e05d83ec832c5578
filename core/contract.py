"""The decode-step contract: graph I/O names, dims, dtypes and cache capacity, read in one place.

One graph serves prefill and decode (export/emit.py writes it):

    inputs   input_ids   int64 [batch, seq]
             position    int64 [batch]                      cache slot of each sequence's first new token
             key_{i}     fp32|fp16|bf16|int8 [batch, H_kv, S_max, D]  layer i key cache (value_{i} alike; the
                         graph's float type, or fp16 / int8 in an fp32 graph: export.build --kv-cache)
             logits_from int64 [1], optional: an input with a default (an initializer of 0) that
                         export.build's ONNX Runtime CPU graphs take; logits are computed for the
                         positions [logits_from, seq) only (the scheduler's prefill asks for the
                         last prompt token's: the head is up to a fifth of a small model's weights)
    outputs  logits      fp32|fp16|bf16 [batch, seq - logits_from, vocab]
             present_key_{i}, present_value_{i}             the caches with the new tokens written

`read_contract` checks a graph's I/O against it and returns a DecodeContract;
export.verify, the runtime sessions, runtime.triton and bench all read it here.
`load_onnx` opens an ONNX file with one clear line for every way it can be broken
(missing, empty, truncated, external data missing or outside the model's folder);
`check_external_data_file` is the last check for loaders that open the file themselves
(ONNX Runtime sessions). Torch-free; onnx is imported
only by the functions that read files.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import UserError, first_line

# ONNX TensorProto element types, ONNX Runtime type strings and numpy names -> one short name
_ONNX_ELEM = {1: "fp32", 10: "fp16", 16: "bf16", 11: "fp64", 7: "int64", 6: "int32", 9: "bool", 2: "uint8",
              3: "int8", 8: "string"}
_ORT_TYPES = {"tensor(float)": "fp32", "tensor(float16)": "fp16", "tensor(bfloat16)": "bf16",
              "tensor(double)": "fp64", "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool",
              "tensor(uint8)": "uint8", "tensor(int8)": "int8", "tensor(string)": "string"}
_NUMPY = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "int64", "int32": "int32",
          "bool": "bool", "uint8": "uint8", "int8": "int8"}
CACHE_DTYPES = ("fp32", "fp16", "bf16", "int8")
# export.build --kv-cache: the cache dtypes a build writes into an fp32 graph (fp16, int8: ONNX Runtime's CPU
# GroupQueryAttention graph, graph_passes/ort_attention.py); a DecodeContract's dtype is its caches'
KV_CACHE_DTYPES = ("fp32", "fp16", "int8")

# The contract's I/O names, spelled here and nowhere else (tests/core/test_contract_names.py greps the tree)
INPUT_IDS = "input_ids"             # int64 [batch, seq]
POSITION = "position"               # int64 [batch]
LOGITS = "logits"                   # [batch, seq - logits_from, vocab]
LOGITS_FROM = "logits_from"         # int64 [1], optional, default 0: the first position logits are computed for
CACHE_KINDS = ("key", "value")
CACHE_PREFIX = "key_"               # how a cache input list is recognised (key_0, key_1, ...)
PRESENT_PREFIX = "present_"


def cache_name(i: int, kind: str) -> str:
    """Layer i's cache input: key_{i} or value_{i}."""
    return f"{kind}_{i}"


def cache_names(n_layer: int) -> list[str]:
    """key_0, value_0, key_1, ... in graph input order."""
    return [cache_name(i, kind) for i in range(n_layer) for kind in CACHE_KINDS]


def present_name(cache: str) -> str:
    """The output that carries cache `cache` with the new tokens written: present_key_{i}."""
    return PRESENT_PREFIX + cache


def io_names(n_layer: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of an n_layer decode-step graph, in graph order."""
    caches = cache_names(n_layer)
    return [INPUT_IDS, POSITION, *caches], [LOGITS, *(present_name(c) for c in caches)]
REEXPORT = "re-export with python -m export.build"


class ContractError(UserError):
    """A graph that is not the decode-step contract, or an ONNX file that cannot be read."""


def dtype_name(t) -> str:
    """Short dtype name (fp32, fp16, int64, ...) from an ONNX elem type, an ORT type string or a numpy dtype."""
    if isinstance(t, int):
        return _ONNX_ELEM.get(t, f"onnx-type-{t}")
    s = str(t)
    return _ORT_TYPES.get(s) or _NUMPY.get(s) or s


def np_dtype(name: str):
    """The numpy dtype of a cache dtype name; bf16 is ml_dtypes' bfloat16 (what onnx itself uses)."""
    import numpy as np
    if name == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp32": np.float32, "fp16": np.float16, "int8": np.int8}[name])


def _dim(d) -> int | None:
    """A static dimension as int, a dynamic one (symbolic name, None, 0 or negative) as None."""
    return d if isinstance(d, int) and d > 0 else None


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str                      # short name: fp32, fp16, int64, ...
    shape: tuple                    # ints for static axes, None for dynamic ones

    def __str__(self) -> str:
        return f"{self.name} {self.dtype}[{', '.join('?' if d is None else str(d) for d in self.shape)}]"


@dataclass(frozen=True)
class DecodeContract:
    """Shapes of the decode-step contract: every cache is [batch, n_kv_head, capacity, head_dim]."""
    n_layer: int
    n_kv_head: int
    head_dim: int
    capacity: int
    vocab_size: int
    dtype: str = "fp32"         # the caches' dtype: fp32 | fp16 | bf16 | int8 (the graph's, or --kv-cache fp16 / int8
                                # in an fp32 graph: sessions allocate caches of it, logits have their own output type)
    inputs: tuple[TensorSpec, ...] = field(default=(), compare=False)
    outputs: tuple[TensorSpec, ...] = field(default=(), compare=False)

    @property
    def takes_logits_from(self) -> bool:
        """Whether the graph computes logits from a given position on (the optional logits_from input)."""
        return any(t.name == LOGITS_FROM for t in self.inputs)

    @property
    def np_dtype(self):
        return np_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return np_dtype(self.dtype).itemsize

    def cache_shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch, self.n_kv_head, self.capacity, self.head_dim)

    def cache_names(self) -> list[str]:
        """key_0, value_0, key_1, ... in graph input order."""
        return cache_names(self.n_layer)

    present_name = staticmethod(present_name)

    def cache_bytes(self, batch: int) -> int:
        b, h, s, d = self.cache_shape(batch)
        return 2 * self.n_layer * b * h * s * d * self.itemsize

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)

    def output(self, name: str) -> TensorSpec:
        return next(t for t in self.outputs if t.name == name)

    @classmethod
    def from_config(cls, cfg, dtype: str = "fp32") -> "DecodeContract":
        """From a models.decoder.DecoderConfig (read by attribute: no import of models)."""
        n_kv = getattr(cfg, "n_kv_head", None) or cfg.n_head
        return cls(cfg.n_layer, n_kv, cfg.head_dim, cfg.max_seq_len, cfg.vocab_size, dtype)


def tensor_specs(values) -> tuple[TensorSpec, ...]:
    """TensorSpecs from {name: (shape, dtype)} (any of the dtype spellings dtype_name reads)."""
    return tuple(TensorSpec(n, dtype_name(t), tuple(_dim(d) for d in (shape or ()))) for n, (shape, t) in values.items())


def read_contract(where, inputs: dict, outputs: dict) -> DecodeContract:
    """The DecodeContract of a graph from its I/O ({name: (shape, dtype)}); ContractError if it is not one.

    The I/O is what actually runs; model metadata is descriptive and not read here.
    """
    ins, outs = tensor_specs(inputs), tensor_specs(outputs)
    by_in, by_out = {t.name: t for t in ins}, {t.name: t for t in outs}

    def fail(expected: str, found: str):
        raise ContractError(f"{where}: expected {expected}, found {found}; {REEXPORT}")

    for name in (INPUT_IDS, POSITION):
        if name not in by_in:
            fail(f"a decode-step graph with input {name!r}", f"inputs {sorted(by_in)[:8]}")
        if by_in[name].dtype != "int64":
            fail(f"{name} of type int64", str(by_in[name]))
    if LOGITS_FROM in by_in and (by_in[LOGITS_FROM].dtype != "int64" or by_in[LOGITS_FROM].shape != (1,)):
        fail(f"{LOGITS_FROM} int64 [1]", str(by_in[LOGITS_FROM]))
    if LOGITS not in by_out:
        fail("output 'logits'", f"outputs {sorted(by_out)[:8]}")
    n_layer = sum(1 for n in by_in if n.startswith(CACHE_PREFIX))
    if n_layer == 0:
        fail("cache inputs key_0, value_0, ...", f"inputs {sorted(by_in)[:8]}")
    for n in cache_names(n_layer):
        if n not in by_in or present_name(n) not in by_out:
            fail(f"input {n} and output {present_name(n)} for each of {n_layer} layers",
                 f"inputs {sorted(by_in)[:8]}..., outputs {sorted(by_out)[:8]}...")
    key = by_in[cache_name(0, "key")]
    if len(key.shape) != 4 or any(d is None for d in key.shape[1:]):
        fail("key_0 of shape [batch, H, S_max, D] with static H, S_max, D", str(key))
    if key.dtype not in CACHE_DTYPES:
        fail(f"caches of type {' or '.join(CACHE_DTYPES)}", str(key))
    for n in cache_names(n_layer):
        for t in (by_in[n], by_out[present_name(n)]):
            if t.dtype != key.dtype or tuple(t.shape[1:]) != tuple(key.shape[1:]):
                fail(f"every cache like key_0 ({key})", str(t))
    logits = by_out[LOGITS]
    if len(logits.shape) != 3 or logits.shape[-1] is None:
        fail("logits [batch, seq, vocab] with a static vocabulary axis", str(logits))
    _, h, s, d = key.shape
    return DecodeContract(n_layer=n_layer, n_kv_head=h, head_dim=d, capacity=s, vocab_size=logits.shape[-1],
                          dtype=key.dtype, inputs=ins, outputs=outs)


# --- ONNX files --------------------------------------------------------------------------------

def onnx_io(proto) -> tuple[dict, dict]:
    """({name: (dims, elem_type)} for inputs, same for outputs) of a ModelProto."""
    def io(values):
        return {v.name: ([d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim],
                         v.type.tensor_type.elem_type) for v in values}
    return io(proto.graph.input), io(proto.graph.output)


def _graph_tensors(graph):
    """Every TensorProto of a graph: initializers (sparse too), node attributes, subgraphs' (If, Loop)."""
    yield from graph.initializer
    for s in graph.sparse_initializer:
        yield from (s.values, s.indices)
    for node in graph.node:
        yield from _attribute_tensors(node)


def _attribute_tensors(node):
    for a in node.attribute:
        yield from (a.t, *a.tensors)
        for s in (a.sparse_tensor, *a.sparse_tensors):
            yield from (s.values, s.indices)
        for g in (a.g, *a.graphs):
            yield from _graph_tensors(g)


def _external_tensors(proto):
    """(tensor, {key: value} of its external data) for every tensor whose data lives in another file:
    the tensors onnx.load_external_data_for_model and ONNX Runtime would read."""
    functions = (t for f in proto.functions for node in f.node for t in _attribute_tensors(node))
    for t in (*_graph_tensors(proto.graph), *functions):
        if t.data_location == 1:          # TensorProto.EXTERNAL
            yield t, {e.key: e.value for e in t.external_data}


def external_files(proto) -> dict[str, int]:
    """External-data file -> bytes it must hold at least, over every tensor."""
    need: dict[str, int] = {}
    for _, info in _external_tensors(proto):
        loc = info.get("location", "")
        end = int(info.get("offset", 0) or 0) + int(info.get("length", 0) or 0)
        need[loc] = max(need.get(loc, 0), end)
    return need


def check_external_data(proto, path: str | os.PathLike) -> None:
    """Refuse (ContractError) an external-data location outside the folder of the model file `path`:
    absolute, escaping with '..', or a link that leads out. A location is resolved against that folder,
    so one that leaves it would make opening a model read (or, via its size, probe) any file the user
    can; every loader of a user's ONNX file calls this before anything touches such a file."""
    folder = Path(path).parent.resolve()
    for t, info in _external_tensors(proto):
        loc = info.get("location", "")
        try:
            inside = not os.path.isabs(loc) and (folder / loc).resolve().is_relative_to(folder)
        except (OSError, ValueError, RuntimeError):      # a NUL byte, a symlink loop
            inside = False
        if not inside:
            raise ContractError(f"{path}: expected external-data locations inside the model's folder {folder}, "
                                f"found {loc!r} (tensor {t.name!r}); an ONNX file may only read data beside it: "
                                "re-export it, or move the data into that folder and name it relative to it")


def check_external_data_file(path: str | os.PathLike) -> None:
    """check_external_data for a file another loader (ONNX Runtime) is about to open: parses the graph,
    not its external weights; a file that does not parse is left to that loader to report."""
    import onnx
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:  # DecodeError, OSError: the loader's own message says what is wrong
        return
    check_external_data(proto, path)


def load_onnx(path: str | os.PathLike, load_weights: bool = True, what: str = "an ONNX model"):
    """onnx.ModelProto from a file, or ContractError naming exactly what is wrong with it."""
    import onnx
    path = Path(path)
    if not path.exists():
        raise ContractError(f"{path}: expected {what}, found no such file; check the path")
    if path.is_dir():
        raise ContractError(f"{path}: expected {what} file, found a directory; name the .onnx file in it")
    try:
        size = path.stat().st_size
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ContractError(f"{path}: expected a readable {what}, found {e.strerror.lower()}; check its permissions") from None
    if size == 0:
        raise ContractError(f"{path}: expected {what}, found an empty file (0 bytes); re-export it")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # DecodeError on truncated or non-ONNX files
        raise ContractError(f"{path}: expected {what}, found a file that does not parse as ONNX "
                            f"({first_line(e)}); it is truncated or not ONNX: re-export it") from None
    if not proto.graph.node and not proto.graph.output:
        raise ContractError(f"{path}: expected {what}, found no graph in it ({size} bytes); it is not an ONNX model: re-export it")
    check_external_data(proto, path)          # before any data file is looked at
    for loc, end in external_files(proto).items():
        data = path.parent / loc
        if not loc or not data.is_file():
            raise ContractError(f"{path}: its weights live in the external-data file {loc or '(unnamed)'}, "
                                f"not found at {data}; copy it beside the model")
        if data.stat().st_size < end:
            raise ContractError(f"{path}: its external-data file {data} holds {data.stat().st_size} bytes, "
                                f"the model needs {end}; it is truncated: copy it again")
    if load_weights:
        try:
            onnx.load_external_data_for_model(proto, str(path.parent))
        except Exception as e:
            raise ContractError(f"{path}: its external data could not be read ({first_line(e)}); copy it again") from None
    return proto


def contract_of(proto_or_path, where=None) -> DecodeContract:
    """DecodeContract of a ModelProto or an .onnx file (weights not loaded for a file)."""
    proto = proto_or_path
    if isinstance(proto_or_path, (str, os.PathLike)):
        where = where or proto_or_path
        proto = load_onnx(proto_or_path, load_weights=False)
    ins, outs = onnx_io(proto)
    return read_contract(where or "graph", ins, outs)
