"""Weights computed when the graph is written: the passes' one weight seam.

    w = Lazy((2048, 512), np.float32, read, key=("blocks.0.attn.q_proj.weight", "T"), group=0)
    w2 = lazy_map(w, lambda a: a * s[:, None])      # a fold: recorded now, computed when w2 is written
    w2.load()                                         # the array (computed again at each call, never kept)

A graph emitted from a checkpoint (export/emit.py) names its large weights without reading them:
each is a Lazy, a constant whose value is a function of the checkpoint's tensors. The passes fold
into such a weight as into any constant, through the functions below (`lazy_map`, `transposed`,
`concat`, `same_values`): on an array they compute now, on a Lazy they record the arithmetic, which
runs when the weight is written (export/pipeline.py), one weight at a time. So the same passes fold
a small model in memory, a foreign graph, and an 8B checkpoint that never is in memory whole.

A Lazy is an onnx-graphsurgeon LazyValues: gs exports its `tensor` (a placeholder TensorProto with
the name, dtype and dims, and no data) instead of loading it, and `const_value` (graph_passes/base.py)
hands the Lazy itself to the passes rather than loading it (gs's Constant.values would load and keep
it). Its `key` says what it is made of, so that two Lazies of the same key hold the same values
(a tied head is the embedding's table transposed: `same_values`) without reading either.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import helper
from onnx_graphsurgeon.ir.tensor import LazyValues

LAZY_LOCATION = "(written by the build)"        # the placeholder's external-data location: never a file


class Lazy(LazyValues):
    """A constant's value computed when written: `compute()` -> array of `shape` and `dtype`."""

    def __init__(self, shape: Sequence[int], dtype, compute: Callable[[], np.ndarray], key: tuple, group: int = -1):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.compute = compute
        self.key = key                   # what it is made of: equal keys, equal values
        self.group = group               # the block it belongs to (-1: embedding, final norm, head): write order
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def tensor(self) -> onnx.TensorProto:
        """A placeholder for gs's exporter (which sets its name): dtype and dims, data said to be elsewhere."""
        t = onnx.TensorProto()
        t.data_type = helper.np_dtype_to_tensor_dtype(self.dtype)
        t.dims.extend(self.shape)
        t.data_location = onnx.TensorProto.EXTERNAL
        t.external_data.add(key="location", value=LAZY_LOCATION)
        return t

    @property
    def packed(self) -> bool:
        """A 4-bit type: load() gives its bytes as ONNX stores them, two values a byte (a uint8 vector)."""
        return self.dtype.itemsize == 1 and self.dtype.name in ("int4", "uint4")

    def load(self) -> np.ndarray:
        value = self.compute()
        expected = ((-(-self.size // 2),), np.dtype(np.uint8)) if self.packed else (self.shape, self.dtype)
        if (value.shape, value.dtype) != expected:
            raise ValueError(f"lazy weight {self.key}: computed {value.dtype}{list(value.shape)}, "
                             f"declared {self.dtype}{list(self.shape)}")
        return value

    def __str__(self) -> str:
        return f"Lazy(shape={self.shape}, dtype={self.dtype}, key={self.key})"

    __repr__ = __str__


Value = "np.ndarray | Lazy"


def lazy_map(value, fn: Callable[[np.ndarray], np.ndarray], shape: Sequence[int] | None = None, dtype=None,
             tag: tuple = ()):
    """fn(value): now for an array; for a Lazy, a new Lazy computing it when written (shape and dtype:
    the result's, default the input's; `tag` extends the key: give one wherever fn is not a pure
    function of the value alone, e.g. a fold's scale)."""
    if not isinstance(value, Lazy):
        return fn(value)
    return Lazy(value.shape if shape is None else shape, value.dtype if dtype is None else dtype,
                lambda: fn(value.load()), value.key + (tag or ("map", id(fn))), value.group)


def transposed(value):
    """value.T (2-D): now for an array, when written for a Lazy; a view either way, never a copy (a real
    model's matrices are read [out, in] and MatMul takes [in, out]: the folds keep the view's layout,
    MatMulNBits' blocks want it, and only a float weight is copied into row order, when written)."""
    if not isinstance(value, Lazy):
        return value.T
    # the key of a transpose's transpose is the original's: a tied head's weight is its embedding's table
    key = value.key[:-1] if value.key[-1:] == ("T",) else value.key + ("T",)
    return Lazy(value.shape[::-1], value.dtype, lambda: value.load().T, key, value.group)


def combine(values: Sequence, fn: Callable[..., np.ndarray], shape: Sequence[int], dtype, tag: tuple):
    """fn(*values): now when every value is an array, else a Lazy that reads the Lazy ones when written (its key:
    `tag` and what each value is made of)."""
    if not any(isinstance(v, Lazy) for v in values):
        return fn(*values)
    key = tag + tuple(v.key if isinstance(v, Lazy) else ("array", digest(np.asarray(v))) for v in values)
    group = max(v.group for v in values if isinstance(v, Lazy))
    return Lazy(shape, dtype, lambda: fn(*[v.load() if isinstance(v, Lazy) else v for v in values]), key, group)


def concat(values: Sequence, axis: int):
    """np.concatenate(values, axis): now when every part is an array, else a Lazy that reads each part when written."""
    axis = axis % values[0].ndim
    shape = list(values[0].shape)
    shape[axis] = sum(v.shape[axis] for v in values)
    return combine(values, lambda *parts: _concatenated(list(parts), axis), shape,
                   np.result_type(*[v.dtype for v in values]), ("concat", axis))


def _concatenated(parts: list[np.ndarray], axis: int) -> np.ndarray:
    """np.concatenate, in the parts' own layout when they are all column-major (transposed views): a
    concatenation of their rows then, not a transposing copy."""
    if all(p.ndim == 2 and p.flags.f_contiguous and not p.flags.c_contiguous for p in parts):
        return np.concatenate([p.T for p in parts], axis=1 - axis).T
    return np.concatenate(parts, axis=axis)


def same_values(a, b) -> bool:
    """Whether a and b hold the same values: compared for arrays, by key for Lazies (never read)."""
    if isinstance(a, Lazy) or isinstance(b, Lazy):
        return isinstance(a, Lazy) and isinstance(b, Lazy) and a.key == b.key
    return a.shape == b.shape and np.array_equal(a, b)


def is_lazy(value) -> bool:
    return isinstance(value, Lazy)


# onnx-graphsurgeon keeps a Constant's values, loaded or not, in its `_values`; its public `values` loads a
# LazyValues and keeps the array. These two functions are the one place that reaches past it.

def put(constant, lazy: Lazy) -> None:
    """Make `constant` (a gs.Constant) hold `lazy`, unread."""
    constant._values = lazy


def stored_lazy(constant) -> Lazy | None:
    """The Lazy a gs.Constant holds (never loading it), or None."""
    value = constant._values
    return value if isinstance(value, Lazy) else None


def digest(*arrays: np.ndarray) -> str:
    """A short name for the values of some arrays (a fold's scale), for a Lazy's key."""
    import hashlib
    h = hashlib.sha1()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def is_placeholder(t: onnx.TensorProto) -> bool:
    """Whether an initializer is a Lazy's placeholder (its data not computed yet)."""
    return t.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == LAZY_LOCATION for e in t.external_data)


def raw_bytes(lazy: Lazy, value: np.ndarray) -> bytes:
    """A Lazy's computed value as ONNX's raw_data (row order, little-endian; 4-bit types already packed)."""
    if lazy.packed:
        return value.tobytes()
    data = np.ascontiguousarray(value)
    if data.dtype.byteorder == ">":
        data = data.byteswap().view(data.dtype.newbyteorder("<"))
    return data.tobytes()


def materialized(proto: onnx.ModelProto, lazy: dict[str, Lazy]) -> onnx.ModelProto:
    """A copy of `proto` with every Lazy placeholder's data computed and inline (small graphs, tests)."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for t in out.graph.initializer:
        if is_placeholder(t):
            w = lazy[t.name]
            raw = raw_bytes(w, w.load())
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
            t.raw_data = raw
    return out


def parts(compute: Callable[[], Sequence[np.ndarray]], specs: Sequence[tuple[Sequence[int], object]], key: tuple,
          group: int = -1) -> list[Lazy]:
    """Lazies of the arrays one computation makes (a matrix's quantized blocks and scales): computed once
    when the first is written, kept until each part has been read, then dropped."""
    kept: dict[str, Sequence[np.ndarray]] = {}
    unread = set(range(len(specs)))

    def part(i: int):
        def load() -> np.ndarray:
            if "values" not in kept:
                kept["values"] = compute()
            value = kept["values"][i]
            unread.discard(i)
            if not unread:                  # every part read: let go (a later read computes again)
                kept.clear()
                unread.update(range(len(specs)))
            return value
        return load
    return [Lazy(shape, dtype, part(i), key + ("part", i), group) for i, (shape, dtype) in enumerate(specs)]
