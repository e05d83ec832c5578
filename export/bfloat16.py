"""bf16 graphs: made from the fp16 graph's structure, checked on a CPU that has no bf16 arithmetic.

    bf16_graph(proto, lazy, keep)        # an emitted bf16 graph after its passes: fp16 types -> bf16, weights fp32 -> bf16
    retype(proto, FLOAT16, BFLOAT16)     # every fp16 type, Cast target and constant -> bf16
    widened_copy(path)                   # beside path: the same graph computing in fp32 (for ORT CPU)

Why from fp16: bf16 and fp16 are both 2-byte floats, and the torch model exported at fp16
already keeps in fp32 what must stay fp32 (softmax statistics, rope angles where the model
computes them so); exporting bf16 again would trace the same graph with another element type.
The weights themselves never pass through fp16: export/emit.py keeps them fp32 through the passes
(the folds computed on the checkpoint's values) and bf16_graph rounds each to bf16 once, a matrix
when it is written.

Why widened: ONNX Runtime's CPU kernels have no bf16 MatMul, Add, Mul, Softmax, ... (checked on
ORT 1.32: only Cast, Concat and the other data-movement ops take bf16), so a bf16 graph cannot run
here. The widened copy keeps every bf16 initializer as it is in the .data file (no second copy of
the weights) and casts it to fp32 where it is used (after a Gather, for an embedding table, so
that the whole table is never widened); everything else computes in fp32. It checks the graph's
structure and every one of its bf16 weights against the torch reference; what it cannot check
is bf16 arithmetic itself, which is the GPU's (bench/gpu_check.sh).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from core.contract import np_dtype

FLOAT, FLOAT16, BFLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
NP = {FLOAT: np.float32, FLOAT16: np.float16, BFLOAT16: np_dtype("bf16")}
WIDENED_SUFFIX = ".widened.onnx"


def convert_tensor(t: onnx.TensorProto, dst: int) -> onnx.TensorProto:
    """A tensor holding its data (inline) in another float type, same name."""
    out = numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32).astype(NP[dst]), t.name)
    out.data_type = dst             # (from_array may not know ml_dtypes' bfloat16 on every onnx version)
    return out


def _retype_nodes(graph: onnx.GraphProto, src: int, dst: int) -> None:
    """Cast targets and tensor-valued attributes (Constant, ConstantOfShape), subgraphs included."""
    for node in graph.node:
        for attr in node.attribute:
            if attr.name == "to" and node.op_type == "Cast" and attr.i == src:
                attr.i = dst
            elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == src:
                attr.t.CopyFrom(convert_tensor(attr.t, dst))
            elif attr.type == onnx.AttributeProto.GRAPH:
                retype_graph(attr.g, src, dst, initializers=True)


def retype_graph(graph: onnx.GraphProto, src: int, dst: int, initializers: bool) -> None:
    """Every `src` element type in `graph` -> `dst`. Initializers: retyped in place (with their
    values when they hold data inline) when `initializers`, else left to the caller."""
    for v in [*graph.input, *graph.output, *graph.value_info]:
        if v.type.tensor_type.elem_type == src:
            v.type.tensor_type.elem_type = dst
    _retype_nodes(graph, src, dst)
    if initializers:
        for init in graph.initializer:
            if init.data_type != src:
                continue
            if init.HasField("raw_data") or len(init.int32_data):     # scalars too: their bits are fp16's
                init.CopyFrom(convert_tensor(init, dst))
            else:
                init.data_type = dst        # data not written yet (a weight computed when written), or empty


def bf16_graph(proto: onnx.ModelProto, lazy: dict, keep: frozenset) -> onnx.ModelProto:
    """An emitted bf16 graph, after its passes (export/emit.py): the fp16 graph's types made bf16, and every
    float weight and constant, fp32 until now, rounded to bf16 once (`keep`: constants fp32 by design, the rope
    frequencies); a Lazy weight (its fold included) when it is written. In place; `lazy` updated."""
    from graph_passes.lazy import Lazy, is_placeholder
    retype_graph(proto.graph, FLOAT16, BFLOAT16, initializers=True)
    bf16 = np.dtype(NP[BFLOAT16])
    for init in proto.graph.initializer:
        if init.data_type != FLOAT or init.name in keep:
            continue
        if is_placeholder(init):
            w = lazy[init.name]
            lazy[init.name] = Lazy(w.shape, bf16, lambda w=w: w.load().astype(bf16), w.key + ("bf16",), w.group)
            init.data_type = BFLOAT16
        else:
            init.CopyFrom(convert_tensor(init, BFLOAT16))
    return proto


def retype(proto: onnx.ModelProto, src: int = FLOAT16, dst: int = BFLOAT16) -> onnx.ModelProto:
    retype_graph(proto.graph, src, dst, initializers=True)
    return proto


def widen(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The bf16 graph computing in fp32; its bf16 initializers kept, cast where they are read.

    Each reader gets its own Cast, placed just before it, so that ONNX Runtime holds one widened
    weight at a time (a Cast of every weight at the top of the graph would keep them all alive:
    the Llama-3.2-1B shape's check peaked at 7.4 GB that way)."""
    graph = proto.graph
    retype_graph(graph, BFLOAT16, FLOAT, initializers=False)
    bf16 = {t.name for t in graph.initializer if t.data_type == BFLOAT16}
    for t in graph.initializer:
        if t.name in bf16:
            t.name += ".bf16"
    nodes = []
    for k, node in enumerate(graph.node):
        gathers_table = node.op_type == "Gather" and node.input[0] in bf16
        for j, name in enumerate(node.input):
            if name not in bf16 or (gathers_table and j == 0):
                continue
            widened = f"{name}.widen.{k}"
            nodes.append(helper.make_node("Cast", [name + ".bf16"], [widened], to=FLOAT, name=widened))
            node.input[j] = widened
        nodes.append(node)
        if gathers_table:                   # a table: gather its bf16 rows, then widen only those
            out = node.output[0]
            node.input[0], node.output[0] = node.input[0] + ".bf16", out + ".bf16"
            nodes.append(helper.make_node("Cast", [out + ".bf16"], [out], to=FLOAT, name=out + ".widen"))
    del graph.node[:]
    graph.node.extend(nodes)
    return proto


def widened_copy(path: Path) -> Path:
    """The widened graph written beside `path` (sharing its .data file); the caller removes it."""
    from core.onnx_writer import save_onnx
    proto = widen(onnx.load(str(path), load_external_data=False))
    out = path.with_name(path.name + WIDENED_SUFFIX)
    save_onnx(proto, out)
    return out
