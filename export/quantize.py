"""Weight-only int8 / int4 quantization of a built graph, after the fold, and the drift it causes.

    model.fused.onnx (fp32) ──quantize_weights──▶ model.int4.onnx (or model.int8.onnx)

        MatMul x @ W, W a constant [K, N]  ──▶  com.microsoft MatMulNBits: W in blocks of
                                                block_size along K, one fp32 scale per block,
                                                symmetric (no zero point)
        Gather(E [V, d], input_ids)        ──▶  com.microsoft GatherBlockQuantized, int4 only
                                                (ORT's quantizer quantizes Gather in 4 bits only)
        a tied head (E = W^T, untouched    ──▶  one table: the embedding's GatherBlockQuantized
        by the fold: norm_gamma leaves it)      reads the head's MatMulNBits blocks (int4 or int8,
                                                the head's bits), as GenAI's builder does; the
                                                values are the same as two separate tables'

ONNX Runtime's own quantizer does the work (onnxruntime.quantization.matmul_nbits_quantizer,
shared/design/METHOD.md "More checked facts"); this module picks what to quantize, records
what it did and measures the result. The folded scales are in the weights by then, so the
quantizer sees the weights the graph really multiplies by. MatMuls of two activations
(attention) stay fp32, and so does the position table (one row read per token).

Algorithms: rtn (round to nearest per block: DefaultWeightOnlyQuantConfig) and hqq
(half-quadratic, int4, MatMul only). Both need no calibration data.

Drift, measured by `measure_drift` against the fp32 graph the quantized one came from:
logits max / mean abs diff on the verifier's sessions, and top-1 agreement over a greedy
run on real text (the fp32 graph generates; both graphs then read the same tokens and
the share of positions where their argmax agrees is reported).
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx

from core.contract import INPUT_IDS, LOGITS
from core.errors import UsageError, UserError

QUANT_BITS = {"int8": 8, "int4": 4}
# --head: the LM head's own weight dtype (default: the --quantize dtype). On the 1M zoo the int4
# head is most of int4's top-1 loss (baseline: 89.8% greedy agreement with every MatMul int4,
# 96.9% with the head in int8, 96.9% with it fp32; bench.quant_quality), as llama.cpp's
# mixed Q4 formats also keep the output matrix in more bits. It costs bytes per token: at
# 124M the head is 38.6M of the 124M parameters.
HEAD_DTYPES = ("int8", "int4", "fp32")
ALGOS = ("rtn", "hqq")
DEFAULT_BLOCK_SIZE = 32        # GenAI's CPU int4 default
# The block sizes ONNX Runtime's weight quantizer takes (its C routine: "Only block sizes 16, 32,
# 64, 128, 256 are supported"); checked up front, as anything else failed only after the export.
BLOCK_SIZES = (16, 32, 64, 128, 256)
# MatMulNBits accuracy_level: the compute type of the CPU kernel. 4 = int8 activations with
# fp32 accumulation (ORT's fastest CPU path, what GenAI's int4 CPU build uses); 0 = the
# kernel's default (fp32), 1 fp32, 2 fp16, 3 bf16.
DEFAULT_ACCURACY_LEVEL = 4
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
GREEDY_TOKENS = 128            # length of the greedy run the top-1 agreement is taken over
# The build fails when the quantized graph's greedy choices agree with the fp32 graph's less
# often than this (teacher-forced, over GREEDY_TOKENS tokens). Measured on the 1M zoo models:
# int8 98%, int4 ~90% (d_model 128 is small for 4 bits). A broken quantization (wrong axis
# or block layout) agrees about as often as chance (~1/vocab); the floors sit far above that
# and below what a working quantization of a small model gives.
MIN_TOP1 = {"int8": 0.90, "int4": 0.70}
META_KEY = "tapernorm.weight_quantization"   # JSON of the QuantConfig, on every quantized graph


class QuantizeError(UserError):
    """A quantization the build cannot do; one line for the user."""


class QuantOptionError(QuantizeError, UsageError):
    """Quantization options that cannot go together or a value no quantizer takes: the command
    line is wrong (exit 2), whatever the model."""


@dataclass(frozen=True)
class QuantConfig:
    dtype: str = "int4"
    block_size: int = DEFAULT_BLOCK_SIZE
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    algo: str = "rtn"
    head: str | None = None          # the LM head's weight dtype (None: dtype)
    int8_layers: tuple[str, ...] = ()   # layer names (or their last parts, e.g. v_proj) kept in int8 under int4

    @property
    def bits(self) -> int:
        return QUANT_BITS[self.dtype]

    @property
    def head_dtype(self) -> str:
        return self.head or self.dtype

    def validate(self) -> None:
        if self.dtype not in QUANT_BITS:
            raise QuantOptionError(f"--quantize {self.dtype!r}: expected one of {', '.join(QUANT_BITS)}; pass one")
        if self.block_size not in BLOCK_SIZES:
            raise QuantOptionError(f"--block-size {self.block_size}: expected one of {', '.join(map(str, BLOCK_SIZES))} "
                                   f"(what ONNX Runtime's quantizer takes); e.g. {DEFAULT_BLOCK_SIZE}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise QuantOptionError(f"--accuracy-level {self.accuracy_level}: expected one of 0..4; e.g. 4 (int8 compute)")
        if self.algo not in ALGOS:
            raise QuantOptionError(f"--algo {self.algo!r}: expected one of {', '.join(ALGOS)}; pass one")
        if self.head is not None and self.head not in HEAD_DTYPES:
            raise QuantOptionError(f"--head {self.head!r}: expected one of {', '.join(HEAD_DTYPES)}; e.g. --head int8")
        if self.int8_layers and (self.dtype != "int4" or self.algo != "rtn"):
            raise QuantOptionError(f"--int8-layers {','.join(self.int8_layers)}: expected --quantize int4 with rtn (it keeps "
                                   f"those layers in int8 among int4 ones), found {self.dtype} with {self.algo}; drop it")
        if self.algo == "hqq" and self.dtype != "int4":
            raise QuantOptionError(f"--algo hqq: expected --quantize int4 (ONNX Runtime's HQQ is 4-bit only), "
                                   f"found {self.dtype}; use --algo rtn for {self.dtype}")

    def file_name(self) -> str:
        return f"model.{self.dtype}.onnx"


@dataclass
class QuantSummary:
    """What quantize_weights did (part of the build report)."""
    config: dict
    matmuls_quantized: int = 0
    matmuls_left: int = 0            # MatMuls of two activations (attention), kept fp32
    gathers_quantized: int = 0
    tied_table: str = ""             # how the tied embedding / head table is stored (or why twice)
    head: str = ""                   # the LM head MatMul's weight dtype in the written graph
    weight_bytes_before: int = 0     # initializer bytes
    weight_bytes_after: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def quantized_config(proto: onnx.ModelProto) -> QuantConfig | None:
    """The QuantConfig a graph was quantized with (its metadata), None for a float graph."""
    for p in proto.metadata_props:
        if p.key == META_KEY:
            fields = json.loads(p.value)
            return QuantConfig(**{**fields, "int8_layers": tuple(fields.get("int8_layers", ()))})
    return None


from core.onnx_writer import initializer_bytes  # noqa: E402,F401  (one rule for weight bytes: the writer's)


def _other_gathers(proto: onnx.ModelProto) -> list[str]:
    """Gather nodes that are not the token embedding (which reads input_ids): the position table."""
    return [n.name for n in proto.graph.node if n.op_type == "Gather" and INPUT_IDS not in n.input]


def _head_matmul(proto: onnx.ModelProto) -> str:
    """Name of the LM head: the MatMul with a constant weight that the `logits` output comes
    from (through at most a few single-path ops such as a bias Add or a Reshape)."""
    inits = {i.name for i in proto.graph.initializer}
    producer = {o: n for n in proto.graph.node for o in n.output}
    name = "logits"
    for _ in range(8):
        node = producer.get(name)
        if node is None:
            break
        if node.op_type == "MatMul" and node.input[1] in inits:
            return node.name
        name = next((i for i in node.input if i and i not in inits), "")
    raise QuantizeError("quantize: expected the logits to come from a MatMul with a constant weight (the LM head), "
                        "found none; quantize a graph exported by export.build")


def _int8_layer_matmuls(proto: onnx.ModelProto, names: tuple[str, ...]) -> list[str]:
    """Node names of the constant-weight MatMuls whose layer (torch module, from the exporter's
    provenance: graph_passes.base.PassContext.layer_name) is one of `names` or ends in ".<name>"
    (v_proj selects blocks.*.attn.v_proj). A name that selects none is an error that lists the
    layers there are: a misspelt name must not quietly leave the layer in int4."""
    from graph_passes.base import PassContext
    ctx = PassContext(proto)
    inits = {i.name for i in proto.graph.initializer}
    linear = [(n.name, ctx.layer_name(n)) for n in ctx.graph.nodes if n.op == "MatMul" and n.inputs[1].name in inits]
    picked = []
    for want in names:
        hits = [node for node, layer in linear if layer == want or layer.endswith("." + want)]
        if not hits:
            known = sorted({layer.rsplit(".", 1)[-1] for _, layer in linear})
            raise QuantizeError(f"--int8-layers {want}: expected the name of a layer with a constant-weight MatMul, "
                                f"found none (layers here end in: {', '.join(known)}); pick from those")
        picked += [h for h in hits if h not in picked]
    return picked


def _token_embedding(proto: onnx.ModelProto, inits: dict) -> onnx.NodeProto | None:
    """The fp32 Gather that reads input_ids from a constant table, or None."""
    return next((n for n in proto.graph.node if n.op_type == "Gather" and INPUT_IDS in n.input[1:]
                 and n.input[0] in inits), None)


def _tied_outputs(proto: onnx.ModelProto) -> tuple[str, str] | None:
    """(embedding output, head output) when the token embedding's table E [V, d] is exactly the LM
    head's weight transposed (a tied head that no fold touched), else None."""
    from onnx import numpy_helper
    inits = {i.name: i for i in proto.graph.initializer}
    try:
        head = next(n for n in proto.graph.node if n.name == _head_matmul(proto))
    except QuantizeError:
        return None
    emb = _token_embedding(proto, inits)
    if emb is None or any(a.name == "axis" and a.i != 0 for a in emb.attribute):
        return None
    w, e = inits[head.input[1]], inits[emb.input[0]]
    if list(w.dims)[::-1] != list(e.dims) or not np.array_equal(numpy_helper.to_array(w).T, numpy_helper.to_array(e)):
        return None
    return emb.output[0], head.output[0]


def _gather_from_blocks(model: onnx.ModelProto, emb, data: str, scales: str, rows: int, bits: int,
                        block: int) -> None:
    """Replace the embedding node `emb` by GatherBlockQuantized(Reshape(data [V, K/block, blob] ->
    [V, -1]), ids, Reshape(scales -> [V, K/block])): rows of MatMulNBits blocks read as a table."""
    from onnx import helper
    g = model.graph
    shape = f"{data}_rows_shape"
    g.initializer.append(onnx.numpy_helper.from_array(np.array([rows, -1], np.int64), shape))
    new = [helper.make_node("Reshape", [data, shape], [f"{data}_rows"], name=f"{emb.name}_table"),
           helper.make_node("Reshape", [scales, shape], [f"{scales}_rows"], name=f"{emb.name}_scales"),
           helper.make_node("GatherBlockQuantized", [f"{data}_rows", emb.input[1], f"{scales}_rows"], list(emb.output),
                            name=f"{emb.name}_blocks", domain="com.microsoft", bits=bits, block_size=block,
                            gather_axis=0, quantize_axis=1)]
    at = list(g.node).index(emb)
    g.node.remove(emb)
    for k, node in enumerate(new):
        g.node.insert(at + k, node)
    used = {i for n in g.node for i in n.input}
    for t in [t for t in g.initializer if t.name in emb.input and t.name not in used]:
        g.initializer.remove(t)


def share_tied_table(model: onnx.ModelProto, tied: tuple[str, str]) -> str:
    """Make the token embedding read the quantized LM head's blocks (stored once), as GenAI's
    builder does, with the head's bits. The head's MatMulNBits packs W [d, V] as V rows of d
    values in blocks along d, which is E [V, d] quantized along d, symmetric (zero point
    2^(bits-1) for both ops). Returns how the table is stored, or why it stays twice."""
    from onnx import helper
    emb_out, head_out = tied
    head = next(n for n in model.graph.node if head_out in n.output)
    emb = next(n for n in model.graph.node if emb_out in n.output)
    if head.op_type != "MatMulNBits":
        return f"stored twice: the LM head is a {head.op_type} (not quantized), the embedding a {emb.op_type}"
    if len(head.input) > 3 and head.input[3]:
        return "stored twice: the LM head's blocks have zero points (asymmetric); the embedding keeps its own table"
    attrs = {a.name: helper.get_attribute_value(a) for a in head.attribute}
    if attrs["K"] % attrs["block_size"]:
        return f"stored twice: d_model {attrs['K']} is not a multiple of the block size {attrs['block_size']}"
    _gather_from_blocks(model, emb, head.input[1], head.input[2], attrs["N"], attrs["bits"], attrs["block_size"])
    return f"stored once: the token embedding reads the LM head's int{attrs['bits']} blocks (GatherBlockQuantized)"


def bias_into_matmulnbits(model: onnx.ModelProto) -> int:
    """Undo graph_passes.ort_bias_sum where the weight is now quantized: Sum(x, MatMulNBits(h), b)
    -> Add(x, MatMulNBits(h, bias=b)). MatMulNBits adds a bias in its own epilogue (input 5), as
    ONNX Runtime's own fusion does for MatMulNBits + Add, so the quantized graph is the one the
    Sums would not have changed (bit-equal logits, same node count). Returns how many."""
    from onnx import helper
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    uses = Counter(i for n in g.node for i in n.input)
    moved = 0
    for at, node in enumerate(list(g.node)):
        if node.op_type != "Sum" or len(node.input) != 3:
            continue
        x, y, b = node.input
        mnb = producers.get(y)
        if mnb is None or mnb.op_type != "MatMulNBits" or uses[y] != 1 or b not in inits \
                or len(mnb.input) > 5 or list(inits[b].dims) != [helper.get_attribute_value(
                    next(a for a in mnb.attribute if a.name == "N"))]:
            continue
        mnb.input.extend([""] * (5 - len(mnb.input)) + [b])
        g.node.remove(node)
        g.node.insert(at, helper.make_node("Add", [x, y], list(node.output), name=node.name))
        moved += 1
    return moved


def quantize_embedding_like_head(model: onnx.ModelProto, cfg: QuantConfig) -> str:
    """An untied fp32 token embedding E [V, d] quantized in the int8 head's format: ORT's quantizer
    has no int8 Gather, so it quantizes a one-MatMul graph whose weight is E^T (the head's rounding)
    and the embedding reads those blocks. On the 1M DyT zoo model (head int8, body int4) an int8
    instead of int4 embedding lifts greedy top-1 agreement from 85.9 % to ~91 %."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    inits = {i.name: i for i in model.graph.initializer}
    emb = _token_embedding(model, inits)
    if emb is None:
        return "no fp32 token embedding left to quantize"
    table = numpy_helper.to_array(inits[emb.input[0]])                                     # [V, d]
    if table.ndim != 2 or table.shape[1] % cfg.block_size:
        return f"token embedding kept fp32: its width is not a multiple of the block size {cfg.block_size}"
    v, d = table.shape
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="rows")], "rows",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, v])],
                          [numpy_helper.from_array(np.ascontiguousarray(table.T), "W")])
    head_cfg = QuantConfig(cfg.head_dtype, cfg.block_size, cfg.accuracy_level, "rtn")
    q = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]),
                             algo_config=algo_config(head_cfg, ("MatMul",)))
    q.process()
    rows = {i.name: numpy_helper.to_array(i) for i in q.model.model.graph.initializer}
    node = q.model.model.graph.node[0]
    data, scales = f"{emb.input[0]}_Q{head_cfg.bits}", f"{emb.input[0]}_scales"
    model.graph.initializer.extend([numpy_helper.from_array(rows[node.input[1]], data),
                                    numpy_helper.from_array(rows[node.input[2]], scales)])
    _gather_from_blocks(model, emb, data, scales, v, head_cfg.bits, cfg.block_size)
    return f"token embedding int{head_cfg.bits} like the head (GatherBlockQuantized)"


def algo_config(cfg: QuantConfig, op_types: tuple[str, ...]):
    from onnxruntime.quantization import matmul_nbits_quantizer as mq
    axes = (("MatMul", 0), ("Gather", 1))     # blocks along K of W [K, N]; along d of E [V, d]
    if cfg.algo == "hqq":
        return mq.HQQWeightOnlyQuantConfig(block_size=cfg.block_size, bits=cfg.bits, op_types_to_quantize=op_types,
                                           quant_axes=axes)
    return mq.DefaultWeightOnlyQuantConfig(block_size=cfg.block_size, is_symmetric=True,
                                           accuracy_level=cfg.accuracy_level, bits=cfg.bits,
                                           op_types_to_quantize=op_types, quant_axes=axes)


def quantize_weights(proto: onnx.ModelProto, cfg: QuantConfig) -> tuple[onnx.ModelProto, QuantSummary]:
    """A copy of `proto` with its constant-weight MatMuls (and, in int4 with rtn, the token
    embedding) quantized; the graph's inputs and outputs are unchanged."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    cfg.validate()
    t0 = time.perf_counter()
    summary = QuantSummary(asdict(cfg), weight_bytes_before=initializer_bytes(proto))
    # The token embedding is stored like the head: int4 in the main pass (ORT quantizes a Gather
    # only in int4 with rtn), int8 after it (quantize_embedding_like_head); one table when tied.
    # Under an fp32 head it stays int4 (memory only: one row a token), under hqq fp32.
    op_types = ("MatMul", "Gather") if cfg.bits == 4 and cfg.algo == "rtn" and cfg.head_dtype != "int8" \
        else ("MatMul",)
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    quiet = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quiet.level
    quiet.setLevel(logging.ERROR)       # it logs one INFO line per weight
    own_head = cfg.head_dtype != cfg.dtype         # the head in other bits: left out of the first pass
    head = _head_matmul(proto) if own_head else None
    int8 = _int8_layer_matmuls(proto, cfg.int8_layers) if cfg.int8_layers else []
    tied = _tied_outputs(proto)
    try:
        q = MatMulNBitsQuantizer(model, nodes_to_exclude=_other_gathers(proto) + ([head] if own_head else []) + int8,
                                 algo_config=algo_config(cfg, op_types))
        q.process()
        out = q.model.model
        if (own_head and cfg.head_dtype == "int8") or int8:   # second pass, int8: the constant MatMuls left
                                                              # (an fp32 head stays fp32)
            q = MatMulNBitsQuantizer(out, nodes_to_exclude=[head] if cfg.head_dtype == "fp32" else [],
                                     algo_config=algo_config(QuantConfig("int8", cfg.block_size, cfg.accuracy_level),
                                                              ("MatMul",)))
            q.process()
            out = q.model.model
        if int8:
            summary.notes.append(f"{len(int8)} MatMul(s) of --int8-layers {','.join(cfg.int8_layers)} in int8")
        summary.tied_table = share_tied_table(out, tied) if tied else \
            "untied: the LM head's weight is not the token embedding's table (or a fold scaled one of them)"
        if not summary.tied_table.startswith("stored once") and cfg.head_dtype == "int8":
            summary.notes.append(quantize_embedding_like_head(out, cfg))
        elif "Gather" not in op_types and not summary.tied_table.startswith("stored once"):
            summary.notes.append("token embedding kept fp32 (" + ("ONNX Runtime's hqq quantizes MatMuls only)"
                                 if cfg.algo == "hqq" else "like the fp32 head; ORT quantizes a Gather in int4 only)"))
        moved = bias_into_matmulnbits(out)
        if moved:
            summary.notes.append(f"{moved} bias(es) moved from a residual Sum into MatMulNBits")
    finally:
        quiet.setLevel(level)
    summary.head = cfg.head_dtype
    ops = [n.op_type for n in out.graph.node]
    summary.matmuls_quantized = ops.count("MatMulNBits")
    summary.matmuls_left = ops.count("MatMul")
    summary.gathers_quantized = ops.count("GatherBlockQuantized")
    if summary.matmuls_quantized == 0:
        raise QuantizeError("quantize: expected MatMuls with constant weights to quantize, found none; "
                            "quantize a graph exported by export.build")
    out.metadata_props.add(key=META_KEY, value=json.dumps(asdict(cfg)))
    summary.weight_bytes_after = initializer_bytes(out)
    summary.seconds = round(time.perf_counter() - t0, 3)
    return out, summary


# --- drift against the fp32 graph --------------------------------------------------------------

@dataclass
class Drift:
    """How far a quantized graph's outputs are from the fp32 graph's."""
    logits_max_abs_diff: float
    logits_mean_abs_diff: float
    logits_max_abs_ref: float            # scale of the logits compared
    top1_agreement: float                # share of positions where both argmaxes agree
    top1_positions: int                  # positions compared (greedy run tokens)
    top1_text: str = "real text"


def logits_diff(ref_runs: list, runs: list) -> tuple[float, float, float]:
    """(max, mean, max |ref|) of |logits - ref logits| over every step of every session."""
    diffs = [np.abs(g[LOGITS].astype(np.float64) - r[LOGITS]) for rs, gs in zip(ref_runs, runs)
             for r, g in zip(rs, gs)]
    refmax = max(float(np.abs(r[LOGITS]).max()) for rs in ref_runs for r in rs)
    return (max(float(d.max()) for d in diffs), float(np.mean([d.mean() for d in diffs])), refmax)


def top1_agreement(ref_sess, sess, iface, prompt: list[int], n: int = GREEDY_TOKENS) -> tuple[float, int]:
    """core.decode.top1_agreement of two ONNX Runtime sessions: the share of n greedy tokens of
    the reference after `prompt` whose argmax the other graph agrees with, teacher-forced, and n."""
    from core.decode import graph_step, top1_agreement as agreement
    return agreement(graph_step(ref_sess), graph_step(sess), iface, prompt, n)


def fit_prompt(tokens: list[int], iface, n: int = GREEDY_TOKENS) -> list[int]:
    """The real-text prompt, cut so that prompt + n greedy tokens fit the cache (at least 1 token)."""
    keep = max(1, min(len(tokens), iface.capacity - n))
    return list(tokens[:keep])
