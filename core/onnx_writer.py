"""The one ONNX writer: a graph with its weights inline, or in one external file beside it.

    save_onnx(proto, path)                          # a graph in memory (graph passes, small builds)
                                                    # (read without its external data: those keep their file,
                                                    #  e.g. a second graph over another's weights, GenAI's I/O)
    with StreamedWeights(path) as w:                # a graph whose weights arrive one at a time
        w.put(initializer_proto, array)              # written now, to path + ".data"; then freed
    ...
    w.save(proto)

One rule for external data: a graph held in memory whose weights reach EXTERNAL_AT keeps them in
`<file>.data` beside `<file>` (protobuf cannot serialize a message over 2 GB, and a loader can
then memory-map the weights), below it inline; a graph whose weights are streamed keeps them
in `<file>.data` whatever their size (inline, they would all be held until the graph is saved). Offsets in the data file are aligned to
ALIGN bytes (the page size), so a runtime can map each tensor without copying it. Numbers
are written little-endian as ONNX's raw_data requires; int4 values are packed two a byte by
the caller (ONNX Runtime's MatMulNBits blobs already are).

The file goes wherever the caller says: atomicity (a temporary path renamed into place) is the
caller's, through core.outputs, which every command already uses; replaced_graph_in is that for a
graph with its `.data` file inside a directory the command owns.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from core.outputs import replaced_files_in, writing

EXTERNAL_AT = 2_000_000_000 - (64 << 20)    # bytes of weights from which a graph keeps them in a .data file
ALIGN = 4096
INLINE_BELOW = 1024     # bytes: small tensors (shapes, scalars) stay in the graph, where shape inference reads them


def data_file_name(path: str | os.PathLike) -> str:
    return Path(path).name + ".data"


# ops that read one row of a table per token (embeddings, the position table): a decode step
# reads a few rows of such a table, not the table
LOOKUP_OPS = frozenset({"Gather", "GatherBlockQuantized"})


def initializer_bytes(proto, per_step: bool = False) -> int:
    """Bytes of a graph's initializers as stored (int4 at half a byte), inline or external.
    per_step: only those one decode step reads whole, i.e. not a table read by lookups alone
    (LOOKUP_OPS); what a step's achieved memory bandwidth is measured against (bench)."""
    import numpy as np
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype
    packed = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)      # two values a byte (numpy holds one a byte)
    readers: dict[str, set[str]] = {}
    if per_step:
        for n in proto.graph.node:
            for i in n.input:
                readers.setdefault(i, set()).add(n.op_type)
    return sum(-(-int(np.prod(t.dims, dtype=np.int64)) // 2) if t.data_type in packed else
               int(np.prod(t.dims, dtype=np.int64)) * tensor_dtype_to_np_dtype(t.data_type).itemsize
               for t in proto.graph.initializer if not (t.name in readers and readers[t.name] <= LOOKUP_OPS))


def inline_bytes(proto) -> int:
    """Bytes of the initializers a graph holds in memory (not those already in an external file)."""
    import onnx
    return sum(t.ByteSize() for t in proto.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL)


def save_onnx(proto, path: str | os.PathLike) -> None:
    """Write a graph held in memory: inline below EXTERNAL_AT, else its weights in `<file>.data`.
    Initializers already external (a graph loaded without its data) keep their file."""
    import onnx
    with writing(path):         # onnx's errors name no file
        if inline_bytes(proto) < EXTERNAL_AT:
            onnx.save(proto, str(path))
        else:
            onnx.save(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                      location=data_file_name(path), size_threshold=1024, convert_attribute=False)


class StreamedWeights:
    """Initializers written one at a time to `<path>.data` (below INLINE_BELOW bytes: into the graph)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.location = data_file_name(path)
        self.bytes = 0
        self._file = None

    def __enter__(self) -> "StreamedWeights":
        self._file = open(self.path.parent / self.location, "wb")
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            with writing(self.path.parent / self.location):
                self._file.close()
            self._file = None

    def put(self, tensor, array) -> None:
        """Store `array` (numpy, already in the tensor's dtype and shape) as the initializer `tensor`
        (an onnx.TensorProto whose name, data_type and dims are set)."""
        import numpy as np
        data = np.ascontiguousarray(array)
        if data.dtype.byteorder == ">":
            data = data.byteswap().view(data.dtype.newbyteorder("<"))
        self.put_raw(tensor, data.reshape(-1).view(np.uint8))

    def put_raw(self, tensor, raw) -> None:
        """Store bytes already in ONNX's raw_data layout (e.g. int4 packed two a byte)."""
        import onnx
        tensor.ClearField("raw_data")
        del tensor.external_data[:]
        n = len(raw) if isinstance(raw, bytes) else raw.nbytes
        self.bytes += n
        if n < INLINE_BELOW:
            tensor.raw_data = bytes(raw)
            tensor.data_location = onnx.TensorProto.DEFAULT
            return
        offset = -(-self._file.tell() // ALIGN) * ALIGN
        self._file.seek(offset)
        with writing(self.path.parent / self.location):
            self._file.write(raw)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", self.location), ("offset", str(offset)), ("length", str(n))):
            tensor.external_data.add(key=k, value=v)

    def save(self, proto) -> None:
        """Write the graph itself (its initializers already put)."""
        import onnx
        if self._file is not None:
            with writing(self.path.parent / self.location):
                self._file.flush()
                os.fsync(self._file.fileno())
        with writing(self.path):
            onnx.save(proto, str(self.path))


@contextlib.contextmanager
def replaced_graph_in(directory: Path, name: str):
    """core.outputs.replaced_file_in for a graph whose weights are in `<name>.data` beside it (the graph records
    that name, so it is written under its own name, in a temporary folder inside `directory`): yields that path;
    on success its weights' file, then the graph, replace those in `directory`; nothing is left otherwise."""
    with replaced_files_in(directory, (data_file_name(name), name)) as work:
        yield work / name
