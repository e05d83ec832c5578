"""The streamed build: a real-size graph written without ever holding the model.

    plan = plan_graph(source, dtype, fuse, attention, quantize)    # the graph, from two small proxies
    write_graph(plan, source, path, log)                           # the weights, block by block

The graph's structure does not depend on the widths d_model, the MLP's hidden size or the
vocabulary: the same ops, in the same order, for any of them. So the structure is taken from
a PROXY: the same config (layers, heads, head width, capacity, rope, norms, biases, gate and
every c) with small widths, random weights, run through the very route a small build takes:
models.fold (the folds as graph_passes does them), export_onnx, the graph passes
(fold_constants; with --attention gqa the ONNX Runtime rewrites), export.quantize. Then every
initializer of the proxy's graph is traced back to what it is made of:

    rows of parameters, maybe transposed  -> the real parameters, folded, transposed, cast
    an ONNX Runtime block quantization of -> the same quantizer run on that real matrix alone
      such a matrix (MatMulNBits, GatherBlockQuantized)
    a constant of the structure           -> kept (masks, rope frequencies, shapes); a shape
                                             holding a width gets the real width

Two proxies with different seeds and widths are built: a constant equal in both belongs to the
structure, a value that differs must be traced to parameters or widths, and anything else is
refused (StreamError) rather than guessed. The real weights are then read one block at a time
(models/weights.py), folded by the same models.fold code, cast or quantized, and written into
the graph's external data as they pass (core/onnx_writer.py). Peak memory: one block in fp32,
or the embedding / LM head, plus the quantizer's copies of one matrix.
"""
from __future__ import annotations

import copy
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from core.errors import UserError
from models.decoder import TORCH_DTYPES, Decoder, DecoderConfig
from models.fold import fold_block_norms, fold_final_norm, fold_norms

DTYPES = ("fp32", "fp16", "bf16")
# the dtype the proxies are exported at: a bf16 graph is the fp16 graph retyped (export/bfloat16.py)
PROXY_DTYPE = {"fp32": "fp32", "fp16": "fp16", "bf16": "fp16"}
PROXY_SEEDS = (0, 1)
WIDTHS = ("d_model", "hidden", "vocab_size")


# the fix of a graph the streamed build cannot plan (there is no --stream option: --route picks the build)
ELSEWHERE = "build with --route in-memory (a bf16 graph: with --fuse, whose folded graph the streamed route plans)"


class StreamError(UserError):
    """A graph the streamed build cannot trace back to the model's weights (one line)."""


# --- the proxies -------------------------------------------------------------------------------

def proxy_widths(cfg: DecoderConfig, block: int, k: int) -> dict[str, int]:
    """Small widths with the same remainders modulo `block` as the real ones (so every
    divisibility test a pass or the quantizer makes comes out the same), all different."""
    return {name: block * (k + j) + getattr(cfg, name) % block for j, name in enumerate(WIDTHS)}


def proxy_model(skeleton: Decoder, widths: dict[str, int], seed: int) -> Decoder:
    """A Decoder with the skeleton's structure at `widths`, random weights, the same gate and c."""
    cfg = replace(skeleton.cfg, d_model=widths["d_model"], mlp_hidden=widths["hidden"],
                  vocab_size=widths["vocab_size"], head_size=skeleton.cfg.head_dim, extra={})
    gen = torch.Generator().manual_seed(seed)
    model = Decoder(cfg)
    with torch.no_grad():
        for p in model.parameters():        # every value distinct, so each row can be recognised
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    if cfg.norm == "taper":
        model.set_gate(skeleton.gate.value)
        for name, layer in model.taper_layers().items():
            layer.c = skeleton.taper_layers()[name].c
    return model.eval()


@dataclass
class Proxy:
    widths: dict[str, int]
    tensors: dict[str, np.ndarray]        # the folded proxy's parameters and buffers, in the graph dtype
    fp: onnx.ModelProto                   # the float graph (after the passes)
    graph: onnx.ModelProto                # the final graph (quantized when asked)
    quantized: object = None              # export.quantize.QuantSummary of that quantization


def build_proxy(skeleton: Decoder, dtype: str, fuse: bool, attention: str, quantize, seed: int, k: int) -> Proxy:
    from export.onnx_export import export_onnx
    from graph_passes import passes_for, run_passes
    block = quantize.block_size if quantize is not None else 16
    widths = proxy_widths(skeleton.cfg, block, k)
    model = proxy_model(skeleton, widths, seed)
    if fuse:
        model = fold_norms(model, keep_tied=True)
    model = model.to(TORCH_DTYPES[dtype])
    tensors = {n: t.detach().numpy().copy() for n, t in [*model.named_parameters(remove_duplicate=False),
                                                          *model.named_buffers()]}
    proto = export_onnx(model, None, dtype,
                        attention="fused" if attention == "gqa" else attention)
    if fuse:
        proto, _ = run_passes(proto, passes_for(attention))
    graph, summary = proto, None
    if quantize is not None:
        from export.quantize import quantize_weights
        graph, summary = quantize_weights(proto, quantize)
    return Proxy(widths, tensors, proto, graph, summary)


# --- tracing initializers ----------------------------------------------------------------------

@dataclass
class Rows:
    """Whole parameters stacked along axis 0 (their rows), transposed when `transpose`."""
    params: list[str]
    transpose: bool = False


@dataclass
class Quantized:
    """Output `role` (input index of the quantized node) of ONNX Runtime's quantizer run on
    the float initializer `source` alone, as a MatMul weight or a Gather table."""
    source: str
    op: str                 # "MatMul" | "Gather" | "MatMulT" (the table transposed, quantized as a MatMul weight)
    role: int
    bits: int


@dataclass
class Const:
    value: np.ndarray       # real-size value


class _Index:
    """Each row (2-D) or vector (1-D) or scalar of the proxy's tensors -> (tensor name, row)."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors
        self.rows: dict[bytes, tuple[str, int]] = {}
        self.vectors: dict[bytes, str] = {}
        for name, t in tensors.items():
            if t.ndim == 2:
                for r in range(t.shape[0]):
                    self.rows.setdefault(t[r].tobytes(), (name, r))
            elif t.ndim <= 1:
                self.vectors.setdefault(t.tobytes() + str(t.shape).encode(), name)

    def _stack(self, x: np.ndarray) -> list[str] | None:
        """The whole tensors whose rows, in order, are x's rows; None if x is not such a stack."""
        names, r = [], 0
        while r < x.shape[0]:
            hit = self.rows.get(x[r].tobytes())
            if hit is None or hit[1] != 0:
                return None
            name = hit[0]
            n = self.tensors[name].shape[0]
            if r + n > x.shape[0] or not np.array_equal(x[r:r + n], self.tensors[name]):
                return None
            names.append(name)
            r += n
        return names

    def trace(self, x: np.ndarray) -> Rows | None:
        if x.ndim == 2:
            names = self._stack(x)
            if names is not None:
                return Rows(names)
            names = self._stack(np.ascontiguousarray(x.T))
            return None if names is None else Rows(names, transpose=True)
        if x.ndim <= 1:
            name = self.vectors.get(x.tobytes() + str(x.shape).encode())
            if name is not None:
                return Rows([name])
            if x.ndim == 1:                   # biases packed side by side (q, k, v)
                names, r = [], 0
                for name, t in self.tensors.items():
                    if t.ndim == 1 and r < x.size and r + t.size <= x.size and np.array_equal(x[r:r + t.size], t):
                        names.append(name)
                        r += t.size
                if r == x.size and names:
                    return Rows(names)
        return None


def _substitute_ints(name: str, x: np.ndarray, y: np.ndarray, widths: dict[tuple[int, int], int]) -> np.ndarray:
    """An integer constant that holds widths: proxy A's widths where proxy B has its own -> real."""
    if x.shape != y.shape:
        raise StreamError(f"streamed build: initializer {name} changes shape with the model's widths "
                          f"({list(x.shape)} vs {list(y.shape)}); {ELSEWHERE}")
    out = x.copy()
    for i in np.flatnonzero(x.reshape(-1) != y.reshape(-1)):
        pair = (int(x.reshape(-1)[i]), int(y.reshape(-1)[i]))
        if pair not in widths:
            raise StreamError(f"streamed build: initializer {name} holds a value that is not a width ({pair}); "
                              f"{ELSEWHERE}")
        out.reshape(-1)[i] = widths[pair]
    return out


_QUANT_SUFFIX = re.compile(r"^(?P<source>.+)_(?:Q(?P<bits>\d+)|scales|zero_points)$")


def _trace_quantized(name: str, graph: onnx.ModelProto, fp_inits: set[str]) -> Quantized | None:
    """A quantizer output (ONNX Runtime names them <weight>_Q<bits>, <weight>_scales,
    <weight>_zero_points), by the node that reads it: a MatMulNBits (a MatMul weight), a
    GatherBlockQuantized (ORT's int4 Gather), or only a Reshape into a GatherBlockQuantized
    (export/quantize.py's embedding stored like the head: its table transposed, quantized as a
    MatMul weight)."""
    m = _QUANT_SUFFIX.match(name)
    if m is None or m.group("source") not in fp_inits:
        return None
    source = m.group("source")
    users = [n for n in graph.graph.node if name in n.input]

    def bits_of(node) -> int:
        return next((helper.get_attribute_value(a) for a in node.attribute if a.name == "bits"), 4)
    for op, kind in (("MatMulNBits", "MatMul"), ("GatherBlockQuantized", "Gather")):
        node = next((n for n in users if n.op_type == op), None)
        if node is not None:
            return Quantized(source, kind, list(node.input).index(name), bits_of(node))
    reshape = next((n for n in users if n.op_type == "Reshape"), None)
    if reshape is None:
        return None
    gather = next((n for n in graph.graph.node if reshape.output[0] in n.input and n.op_type == "GatherBlockQuantized"),
                  None)
    if gather is None:
        return None
    role = 1 if m.group("bits") else (2 if name.endswith("_scales") else 3)     # MatMulNBits' B, scales, zero points
    return Quantized(source, "MatMulT", role, bits_of(gather))


@dataclass
class GraphPlan:
    """A real-size graph without its weights, and how to make each initializer."""
    proto: onnx.ModelProto                         # initializers: name, dtype, dims (no data)
    recipes: dict[str, Rows | Quantized | Const]
    float_recipes: dict[str, Rows | Const]         # the float initializers a Quantized recipe reads
    dtype: str
    fuse: bool
    quantize: object = None
    notes: list[str] = field(default_factory=list)
    # the quantized proxy's QuantSummary: what the graph passes rewrote and left alone, the same sites
    # at the real size (the proxies keep the widths' remainders modulo the block size)
    quantized: object = None


def plan_graph(source, dtype: str = "fp32", fuse: bool = True, attention: str = "plain", quantize=None) -> GraphPlan:
    """Build the two proxies and trace every initializer of the final graph (see the module doc)."""
    if dtype not in DTYPES:
        raise StreamError(f"--dtype {dtype}: the streamed build writes {', '.join(DTYPES)}; pick one")
    skeleton = source.skeleton
    a = build_proxy(skeleton, PROXY_DTYPE[dtype], fuse, attention, quantize, PROXY_SEEDS[0], k=2)
    b = build_proxy(skeleton, PROXY_DTYPE[dtype], fuse, attention, quantize, PROXY_SEEDS[1], k=5)
    widths = {(a.widths[n], b.widths[n]): getattr(skeleton.cfg, n) for n in WIDTHS}     # proxy A's, B's -> real
    ops_a, ops_b = [n.op_type for n in a.graph.graph.node], [n.op_type for n in b.graph.graph.node]
    if ops_a != ops_b:
        raise StreamError(f"streamed build: the graph's ops depend on the model's widths; {ELSEWHERE}")
    index_a, index_b = _Index(a.tensors), _Index(b.tensors)
    fp_inits = {i.name for i in a.fp.graph.initializer}
    inits_b = {i.name: numpy_helper.to_array(i) for i in b.graph.graph.initializer}
    fp_b = {i.name: numpy_helper.to_array(i) for i in b.fp.graph.initializer}
    fp_a = {i.name: numpy_helper.to_array(i) for i in a.fp.graph.initializer}

    def trace_float(name: str, x: np.ndarray, y: np.ndarray):
        if x.shape == y.shape and np.array_equal(x, y):
            return Const(x)                                     # the structure's (same in both proxies)
        if np.issubdtype(x.dtype, np.integer):
            return Const(_substitute_ints(name, x, y, widths))
        rows = index_a.trace(x)
        if rows is None or index_b.trace(y) != rows:
            raise StreamError(f"streamed build: initializer {name} {list(x.shape)} is not made of the model's "
                              f"parameters in a way the streamed build follows; {ELSEWHERE}")
        return rows

    recipes, float_recipes = {}, {}
    for init in a.graph.graph.initializer:
        name = init.name
        q = _trace_quantized(name, a.graph, fp_inits) if quantize is not None and name not in fp_inits else None
        if q is not None:
            recipes[name] = q
            float_recipes[q.source] = trace_float(q.source, fp_a[q.source], fp_b[q.source])
        else:
            recipes[name] = trace_float(name, numpy_helper.to_array(init), inits_b[name])
    proto = _real_size_graph(a, b, widths, recipes, skeleton, dtype)
    if dtype == "bf16":
        from export.bfloat16 import NP, retype
        retype(proto)
        for name, r in recipes.items():
            if isinstance(r, Const) and r.value.dtype == np.float16:
                recipes[name] = Const(r.value.astype(np.float32).astype(NP[onnx.TensorProto.BFLOAT16]))
    return GraphPlan(proto, recipes, float_recipes, dtype, fuse, quantize, quantized=a.quantized)


def _real_size_graph(a: Proxy, b: Proxy, widths, recipes, skeleton: Decoder, dtype: str) -> onnx.ModelProto:
    """Proxy A's graph with real widths in attributes, I/O shapes and metadata; initializers
    emptied (their data is written by write_graph)."""
    from export.onnx_export import model_metadata
    proto = onnx.ModelProto()
    proto.CopyFrom(a.graph)
    for na, nb in zip(proto.graph.node, b.graph.graph.node):
        for attr, battr in zip(na.attribute, nb.attribute):
            if attr.type == onnx.AttributeProto.INT and attr.i != battr.i:
                if (attr.i, battr.i) not in widths:
                    raise StreamError(f"streamed build: node {na.name} attribute {attr.name} depends on the widths "
                                      f"in a way the streamed build does not follow; {ELSEWHERE}")
                attr.i = widths[(attr.i, battr.i)]
    for va, vb in zip([*proto.graph.input, *proto.graph.output], [*b.graph.graph.input, *b.graph.graph.output]):
        for da, db in zip(va.type.tensor_type.shape.dim, vb.type.tensor_type.shape.dim):
            if da.HasField("dim_value") and da.dim_value != db.dim_value:
                da.dim_value = widths[(da.dim_value, db.dim_value)]
    del proto.graph.value_info[:]
    meta = {p.key: p.value for p in proto.metadata_props}
    meta.update(model_metadata(skeleton, dtype))
    del proto.metadata_props[:]
    for k, v in meta.items():
        proto.metadata_props.add(key=k, value=v)
    for init in proto.graph.initializer:
        init.ClearField("raw_data")
        for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            init.ClearField(f)
        del init.dims[:]
    return proto


# --- writing -----------------------------------------------------------------------------------

def _group(name: str) -> int:
    """The block a parameter belongs to (-1: embedding, positions, final norm, head)."""
    m = re.match(r"blocks\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _rows_value(recipe: Rows, tensors: dict[str, torch.Tensor], np_dtype) -> np.ndarray:
    parts = [tensors[n].detach().to(torch.float32).numpy() for n in recipe.params]
    if np_dtype == np.float16:          # read and folded; checked before the cast (fp16's range)
        from export.pipeline import check_fp16_range
        for n, part in zip(recipe.params, parts):
            if part.size:
                check_fp16_range(n, part.min(), part.max())
    x = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    if recipe.transpose:
        x = transposed(x)
    return np.ascontiguousarray(x.astype(np_dtype, copy=False))


def transposed(x: np.ndarray) -> np.ndarray:
    """x.T, contiguous, by torch's transposing copy: faster than numpy's on a real model's matrices
    (0.23-0.35 s against 0.37-0.62 s on a 14336 x 4096 fp32 matrix)."""
    return torch.from_numpy(x).t().contiguous().numpy()


def _rtn_matmul_blocks(w: np.ndarray, bits: int, block: int) -> dict[int, onnx.TensorProto]:
    """What ONNX Runtime's quantizer writes for the MatMul weight w [K, N] (rtn, symmetric): its own
    C++ kernel called as DefaultWeightOnlyQuantizer.qbits_block_quant calls it, without the one-node
    graph's copies of w (a real LM head is a GB); tests/export/test_stream.py checks the bytes equal."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits
    w = np.ascontiguousarray(w, dtype=np.float32)
    rows, cols = w.shape
    k_blocks, kpack = -(-rows // block), 8 // bits
    if k_blocks * block != rows:
        w = np.pad(w, ((0, k_blocks * block - rows), (0, 0)), "constant")
    packed = np.zeros((cols, k_blocks, block // kpack), dtype=np.uint8)           # [N, K/block, blob]
    zero_point = np.zeros((cols, -(-k_blocks // kpack)), dtype=np.uint8)
    scales = np.zeros((cols, k_blocks), dtype=np.float32)
    (quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits)(packed, w, scales, zero_point, block, cols, rows, True)
    return {1: numpy_helper.from_array(packed), 2: numpy_helper.from_array(scales)}


def quantize_one(x: np.ndarray, q: Quantized, qcfg) -> dict[int, onnx.TensorProto]:
    """ONNX Runtime's quantizer on one matrix alone: input index -> the tensor it writes, as it
    would for that matrix inside the whole graph (the quantizer treats each weight on its own)."""
    from export.quantize import QuantConfig, quantize_one_node
    bits_cfg = QuantConfig("int8" if q.bits == 8 else "int4", qcfg.block_size, qcfg.accuracy_level,
                           qcfg.algo if q.bits == 4 else "rtn")
    if q.op != "Gather" and bits_cfg.algo == "rtn":
        return _rtn_matmul_blocks(transposed(x) if q.op == "MatMulT" else x, q.bits, qcfg.block_size)
    if q.op == "Gather":
        return quantize_table(x, bits_cfg)
    return quantize_one_node("MatMul", x.T if q.op == "MatMulT" else x, bits_cfg)


TABLE_CHUNK_BYTES = 1 << 30     # protobuf's 2 GiB limit on the one-node graph: Qwen3-8B's table is 2.5 GB


def quantize_table(table: np.ndarray, qcfg, chunk_bytes: int = TABLE_CHUNK_BYTES) -> dict[int, onnx.TensorProto]:
    """GatherBlockQuantized's tensors of an embedding table [V, d], ONNX Runtime's quantizer on row chunks of
    at most chunk_bytes: each row's blocks are its own (quant axis 1), so the chunks' tensors stacked along the
    rows are the whole table's (tests/export/test_stream.py checks them equal)."""
    from export.quantize import quantize_one_node
    rows = max(1, chunk_bytes // max(1, table.shape[1] * table.itemsize))
    if rows >= table.shape[0]:
        return quantize_one_node("Gather", table, qcfg)
    parts = [quantize_one_node("Gather", table[i:i + rows], qcfg) for i in range(0, table.shape[0], rows)]
    return {k: numpy_helper.from_array(np.concatenate([numpy_helper.to_array(p[k]) for p in parts], axis=0),
                                       parts[0][k].name) for k in parts[0]}


def load_top(source, fuse: bool) -> Decoder:
    """The model without its blocks (embedding, positions, final norm, head), real weights, the
    final norm folded as the graph passes fold it (with fuse)."""
    top = copy.deepcopy(source.skeleton)
    top.blocks = torch.nn.ModuleList()
    top = source.fill(top, "")
    for rotary in top.rotaries().values():       # non-persistent buffers: to_empty left them unset
        rotary.reset_parameters()
    if fuse:
        fold_final_norm(top, keep_tied=True)
    return top


def _load_group(source, group: int, fuse: bool) -> dict[str, torch.Tensor]:
    """The real, folded (with fuse) parameters and buffers of one block, or of the rest (group -1), by name."""
    if group >= 0:
        block = source.block(group)
        if fuse:
            fold_block_norms(block)
        module, prefix = block, f"blocks.{group}."
    else:
        module, prefix = load_top(source, fuse), ""
    return {prefix + n: t for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]}


def write_graph(plan: GraphPlan, source, path, log=print) -> int:
    """Write the plan's graph to `path`, its weights read, folded, cast / quantized and written
    one block at a time. Returns the bytes of weights written."""
    from core.contract import np_dtype as np_dtype_of
    from core.onnx_writer import StreamedWeights
    np_dtype = np_dtype_of(plan.dtype)
    inits = {i.name: i for i in plan.proto.graph.initializer}
    by_group: dict[int, list[str]] = defaultdict(list)
    for name, recipe in plan.recipes.items():
        read = plan.float_recipes[recipe.source] if isinstance(recipe, Quantized) else recipe
        groups = {_group(p) for p in (read.params if isinstance(read, Rows) else [])} or {-1}
        if len(groups) > 1:
            raise StreamError(f"streamed build: initializer {name} mixes parameters of several blocks; "
                              f"{ELSEWHERE}")
        by_group[groups.pop()].append(name)
    order = sorted(by_group, key=lambda g: (g < 0, g))
    # always beside the graph: weights kept inline would all be held until the graph is saved
    # (GPT-2 medium's 1.6 GB peaked at 8 GB that way)
    with StreamedWeights(path) as out:
        for k, group in enumerate(order):
            tensors = _load_group(source, group, plan.fuse)
            quantized_cache: dict[tuple[str, str, int], dict[int, np.ndarray]] = {}
            for name in by_group[group]:
                recipe = plan.recipes[name]
                if isinstance(recipe, Const):
                    value = recipe.value
                elif isinstance(recipe, Rows):
                    value = _rows_value(recipe, tensors, np_dtype)
                else:
                    key = (recipe.source, recipe.op, recipe.bits)
                    if key not in quantized_cache:
                        fp = plan.float_recipes[recipe.source]
                        x = fp.value if isinstance(fp, Const) else _rows_value(fp, tensors, np.float32)
                        quantized_cache[key] = quantize_one(x, recipe, plan.quantize)
                    value = quantized_cache[key][recipe.role]
                init = inits[name]
                del init.dims[:]
                if isinstance(value, onnx.TensorProto):      # the quantizer's own tensor: its dtype (e.g. uint4) and bytes
                    init.dims.extend(value.dims)
                    init.data_type = value.data_type
                    out.put_raw(init, value.raw_data if value.HasField("raw_data")
                                else numpy_helper.to_array(value).tobytes())
                else:
                    init.dims.extend(value.shape)
                    init.data_type = helper.np_dtype_to_tensor_dtype(value.dtype)
                    out.put(init, value)
            del tensors, quantized_cache
            what = f"block {group + 1}/{source.cfg.n_layer}" if group >= 0 else "embedding, final norm, head"
            log(f"      [{k + 1}/{len(order)}] {what}: {len(by_group[group])} initializer(s), "
                f"{out.bytes / 1e6:,.0f} MB written")
        out.save(plan.proto)
    return out.bytes
