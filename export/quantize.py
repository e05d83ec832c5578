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
shared/design/METHOD.md "More checked facts"); this module picks what to quantize, calls it,
runs the graph passes that rewrite its output (graph_passes/quantized.py: the tied table, the
embedding like the head, biases into MatMulNBits) and records what they did and left alone.
The folded scales are in the weights by then, so the quantizer sees the weights the graph
really multiplies by. MatMuls of two activations
(attention) stay fp32, and so does the position table (one row read per token).

Algorithms: rtn (round to nearest per block: DefaultWeightOnlyQuantConfig) and hqq
(half-quadratic, int4, MatMul only). Both need no calibration data.

Drift against the float model (`logits_diff`; the build reports it, export/reference_check.py):
logits max / mean abs diff on the verifier's sessions, and the teacher-forced top-1 agreement on
real text (both models read the same AGREEMENT_TOKENS tokens; the share of positions where their
argmax agrees; MIN_TOP1 is its floor). bench.quant_quality also measures the greedy top-1 agreement
(the float model generates; core.decode.greedy_top1_agreement).
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx

from core.build_files import quantized_name
from core.contract import LOGITS
from core.errors import UsageError, UserError
from core.onnx_writer import initializer_bytes

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
AGREEMENT_TOKENS = 128         # positions of real text the top-1 agreement is taken over
# The build fails when the quantized graph's top-1 choices agree with the float model's less
# often than this (teacher-forced on real text, AGREEMENT_TOKENS positions). Measured on the 1M zoo models:
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
        return quantized_name(self.dtype)


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
    notes: list[str] = field(default_factory=list)                  # what was left alone, and why
    rewritten: list[dict] = field(default_factory=list)   # pass, layer, detail: the graph passes' rewrites


def quantized_config(proto: onnx.ModelProto) -> QuantConfig | None:
    """The QuantConfig a graph was quantized with (its metadata), None for a float graph."""
    for p in proto.metadata_props:
        if p.key == META_KEY:
            fields = json.loads(p.value)
            return QuantConfig(**{**fields, "int8_layers": tuple(fields.get("int8_layers", ()))})
    return None


def head_name(graph) -> str:
    """Node name of the LM head (the MatMul the logits come from) of a ModelProto or a PassContext, or a
    one-line error."""
    from graph_passes.quantized import head_matmul, head_node
    head = head_matmul(graph) if isinstance(graph, onnx.ModelProto) else head_node(graph)
    if head is None:
        raise QuantizeError("quantize: expected the logits to come from a MatMul with a constant weight (the LM head), "
                            "found none; quantize a graph exported by export.build")
    return head.name


def _int8_layer_matmuls(ctx, names: tuple[str, ...]) -> list[str]:
    """Node names of the constant-weight MatMuls whose layer (torch module, from the graph's
    provenance: graph_passes.base.PassContext.layer_name) is one of `names` or ends in ".<name>"
    (v_proj selects blocks.*.attn.v_proj). A name that selects none is an error that lists the
    layers there are: a misspelt name must not quietly leave the layer in int4."""
    from graph_passes.base import const_value
    linear = [(n.name, ctx.layer_name(n)) for n in ctx.graph.nodes
              if n.op == "MatMul" and const_value(n.inputs[1]) is not None and const_value(n.inputs[0]) is None]
    picked = []
    for want in names:
        hits = [node for node, layer in linear if layer == want or layer.endswith("." + want)]
        if not hits:
            known = sorted({layer.rsplit(".", 1)[-1] for _, layer in linear})
            raise QuantizeError(f"--int8-layers {want}: expected the name of a layer with a constant-weight MatMul, "
                                f"found none (layers here end in: {', '.join(known)}); pick from those")
        picked += [h for h in hits if h not in picked]
    return picked


@contextlib.contextmanager
def quiet_quantizer():
    """ONNX Runtime's weight quantizer at ERROR while it runs (it logs one INFO line per weight)."""
    log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def algo_config(cfg: QuantConfig, op_types: tuple[str, ...]):
    from onnxruntime.quantization import matmul_nbits_quantizer as mq
    axes = (("MatMul", 0), ("Gather", 1))     # blocks along K of W [K, N]; along d of E [V, d]
    if cfg.algo == "hqq":
        return mq.HQQWeightOnlyQuantConfig(block_size=cfg.block_size, bits=cfg.bits, op_types_to_quantize=op_types,
                                           quant_axes=axes)
    return mq.DefaultWeightOnlyQuantConfig(block_size=cfg.block_size, is_symmetric=True,
                                           accuracy_level=cfg.accuracy_level, bits=cfg.bits,
                                           op_types_to_quantize=op_types, quant_axes=axes)


# The largest |w| a weight may hold to be quantized. MatMulNBits computes (int8 activations at accuracy level 4)
# sum over K of (activation scale x weight scale x an integer dot product) in fp32, so a weight scale near
# fp32's 3.4e38 (a 3e38 weight: scale 3.75e37) overflows to inf, while the float reference stays finite:
# the build then failed its verification with one line per output and no cause. Trained and folded weights
# are far below this (the LN-free GPT-2's folded 1e6 / std gains give |w| ~ 1e5), and 2^64 leaves
# activations of 1e4 summed over 1e5 channels a factor 1e10 from overflow.
QUANT_MAX_ABS = 2.0 ** 64


class WeightRangeError(QuantizeError):
    """A weight that cannot be quantized: not finite, or beyond QUANT_MAX_ABS."""


def check_weight_range(w: np.ndarray, where: str, dtype: str) -> None:
    """WeightRangeError (one line naming the weight and the fix) for a weight --quantize cannot hold."""
    peak = max(float(w.max()), -float(w.min())) if w.size else 0.0      # (no |w| copy; a NaN propagates)
    if not peak <= QUANT_MAX_ABS:          # NaN fails too
        found = "NaN or inf" if not np.isfinite(peak) else f"|w| up to {peak:.3g}"
        raise WeightRangeError(f"{where}: expected finite weights of magnitude <= {QUANT_MAX_ABS:.3g} to quantize to "
                               f"{dtype}, found {found} (after folding the norm gains into it); build without "
                               "--quantize, or check the checkpoint (a weight this large is corrupt or overflowed)")


class BlockQuantizer:
    """graph_passes.quantized.Quantizer of a QuantConfig: rtn by export/rtn.py (byte for byte ONNX Runtime's
    quantizer), hqq by ONNX Runtime's public quantizer on a one-node graph (it computes with torch). Each
    weight is quantized alone when the graph is written."""

    def __init__(self, cfg: QuantConfig):
        self.cfg = cfg

    def layout(self, op: str, shape: tuple, bits: int):
        block = self.cfg.block_size
        if op == "Gather":                       # a table [V, d], int4, blocks along d
            v, d = shape
            import ml_dtypes
            return ("GatherBlockQuantized", {"block_size": block, "gather_axis": 0, "quantize_axis": 1},
                    [("_Q4", (v, d), np.dtype(ml_dtypes.int4)), ("_scales", (v, -(-d // block)), np.float32)])
        k, n = shape                             # W [K, N], blocks along K
        k_blocks = -(-k // block)
        attrs = {"K": k, "N": n, "bits": bits, "block_size": block}
        data = (f"_Q{bits}", (n, k_blocks, block * bits // 8), np.uint8)
        if self.cfg.algo == "hqq" and bits == 4:     # its scales and zero points flat, one per block
            return "MatMulNBits", attrs, [data, ("_scales", (n * k_blocks,), np.float32),
                                          ("_zero_points", (n * k_blocks,), np.float32)]
        return "MatMulNBits", {**attrs, "accuracy_level": self.cfg.accuracy_level}, \
            [data, ("_scales", (n, k_blocks), np.float32)]

    def blocks(self, op: str, w: np.ndarray, bits: int, where: str = "") -> list[np.ndarray]:
        from export import rtn
        where = where or f"a {op} weight {list(w.shape)}"
        if op == "MatMul" and not (self.cfg.algo == "hqq" and bits == 4):
            # the range check read from the scales (max |scale| x 2^(bits-1) is max |w|, exactly: the scale is
            # the block's extreme over a power of 2), not from another pass over w; rtn refuses NaN and inf
            try:
                B, scales = _by_columns(w.astype(np.float32, copy=False), bits, self.cfg.block_size)
            except ValueError:
                check_weight_range(w, where, f"int{bits}")      # NaN or inf: said as the range check says it
                raise
            if scales.size and not float(np.abs(scales).max()) * (1 << (bits - 1)) <= QUANT_MAX_ABS:
                check_weight_range(w, where, f"int{bits}")
            return [B, scales]
        check_weight_range(w, where, f"int{bits}")
        if op == "Gather":
            t = rtn.gather_blocks(np.ascontiguousarray(w, np.float32), 4, self.cfg.block_size)   # a table: rows
            return [t.data, t.scales]
        from onnx import numpy_helper
        out = quantize_one_node("MatMul", w, self.cfg)                  # hqq
        return [numpy_helper.to_array(out[i]) for i in (1, 2, 3)]

    def head_blocks(self, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """An embedding table E [V, d] in the int8 head's format: E^T quantized as a MatMul weight (the head's
        rounding; ORT has no int8 Gather): its blocks [V, d/block, blob] and scales. On the 1M DyT zoo model
        (head int8, body int4) an int8 instead of int4 embedding lifts greedy top-1 agreement from 85.9 % to ~91 %."""
        from export import rtn
        return rtn.matmul_blocks(table.T.astype(np.float32, copy=False), QUANT_BITS[self.cfg.head_dtype],
                                 self.cfg.block_size)


def _by_columns(w: np.ndarray, bits: int, block: int, min_columns: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """export.rtn.matmul_blocks of w [K, N], its columns split over this machine's cores (numpy lets go of the
    GIL in its loops): each column's blocks are its own, so the parts' blocks side by side are the whole's
    (tests/export/test_quantize.py); 1.7x faster on 2 cores on a real LM head."""
    import os
    from concurrent.futures import ThreadPoolExecutor
    from export import rtn
    n = w.shape[1]
    parts = max(1, min(os.cpu_count() or 1, n // min_columns))
    if parts == 1:
        return rtn.matmul_blocks(w, bits, block)
    cuts = [n * i // parts for i in range(parts + 1)]
    with ThreadPoolExecutor(parts) as pool:
        done = list(pool.map(lambda i: rtn.matmul_blocks(w[:, cuts[i]:cuts[i + 1]], bits, block), range(parts)))
    return np.concatenate([b for b, _ in done]), np.concatenate([s for _, s in done])


def quantize_weights(proto: onnx.ModelProto, cfg: QuantConfig,
                     lazy: dict | None = None) -> tuple[onnx.ModelProto, QuantSummary]:
    """`proto` with its constant-weight MatMuls (and, in int4 with rtn, the token embedding) quantized
    (graph_passes/quantized.py); the graph's inputs and outputs are unchanged. `lazy`: the graph's weights
    computed when written (export/emit.py), replaced in place by the quantized graph's, whose blocks are
    computed when written too; without it, a graph in memory, returned with its blocks computed. (A build
    quantizes the graph it has loaded for its folds: quantize_passes, then quantized_graph.)"""
    from graph_passes.base import load_graph, save_graph
    from graph_passes.lazy import materialized
    cfg.validate()
    ctx = load_graph(proto, lazy)
    summary = quantize_passes(ctx, cfg)
    out = save_graph(ctx, proto)
    if lazy is None:
        out = materialized(out, ctx.lazy_weights())
    else:
        lazy.clear()
        lazy.update(ctx.lazy_weights())
    return quantized_graph(out, cfg, summary), summary


def quantize_passes(ctx, cfg: QuantConfig) -> QuantSummary:
    """The quantization passes on a loaded float graph (a graph_passes PassContext, rewritten in place), through
    graph_passes.run_passes_in; returns what they did (quantized_graph completes it once the graph is saved)."""
    from graph_passes import run_passes_in
    from graph_passes.quantized import QuantizeWeights, find_tie
    t0 = time.perf_counter()
    summary = QuantSummary(asdict(cfg), head=cfg.head_dtype, weight_bytes_before=ctx.weight_bytes())
    tie = find_tie(ctx)                 # on the float graph: `quantize` rewrites both tables
    head = head_name(ctx)
    int8 = set(_int8_layer_matmuls(ctx, cfg.int8_layers)) if cfg.int8_layers else set()
    if int8:
        summary.notes.append(f"{len(int8)} MatMul(s) of --int8-layers {','.join(cfg.int8_layers)} in int8")
    gathers = cfg.bits == 4 and cfg.algo == "rtn" and cfg.head_dtype != "int8"

    def bits_of(layer: str, node) -> int | None:
        if node.op == "Gather":
            return 4 if gathers else None
        if node.name == head:
            return {"fp32": None, "int8": 8, "int4": 4}[cfg.head_dtype]
        return 8 if node.name in int8 else cfg.bits
    quantizer = BlockQuantizer(cfg)
    results = run_passes_in(ctx, [QuantizeWeights(quantizer, bits_of), *_passes(cfg, tie, quantizer)])
    _record_passes(summary, results[1:], cfg, gathers)
    summary.seconds = round(time.perf_counter() - t0, 3)
    return summary


def quantized_graph(out: onnx.ModelProto, cfg: QuantConfig, summary: QuantSummary) -> onnx.ModelProto:
    """The saved graph of quantize_passes: its counts in `summary` (a graph with nothing quantized is refused)
    and the QuantConfig in its metadata (quantized_config reads it back)."""
    ops = [n.op_type for n in out.graph.node]
    summary.matmuls_quantized = ops.count("MatMulNBits")
    summary.matmuls_left = ops.count("MatMul")
    summary.gathers_quantized = ops.count("GatherBlockQuantized")
    if summary.matmuls_quantized == 0:
        raise QuantizeError("quantize: expected MatMuls with constant weights to quantize, found none; "
                            "quantize a graph exported by export.build")
    out.metadata_props.add(key=META_KEY, value=json.dumps(asdict(cfg)))
    summary.weight_bytes_after = initializer_bytes(out)
    return out


def _passes(cfg: QuantConfig, tie, quantizer: BlockQuantizer) -> list:
    """The rewrites after `quantize` (graph_passes/quantized.py), in order: the tied table first (an
    embedding it shares is no longer an fp32 Gather for EmbeddingLikeHead)."""
    from graph_passes.quantized import BiasIntoMatMulNBits, EmbeddingLikeHead, ShareTiedTable
    passes = [ShareTiedTable(tie)]
    if cfg.head_dtype == "int8":
        passes.append(EmbeddingLikeHead(quantizer.head_blocks, QUANT_BITS[cfg.head_dtype], cfg.block_size))
    return passes + [BiasIntoMatMulNBits()]


def _record_passes(summary: QuantSummary, results: list, cfg: QuantConfig, gathers: bool) -> None:
    """The passes' rewrites and the candidates they left alone, in the summary (as a build reports its folds)."""
    from graph_passes.quantized import UNTIED
    tied = results[0]
    summary.tied_table = next((f.detail for f in tied.folded), next((f.why for f in tied.skipped), UNTIED))
    summary.rewritten += [{"pass": r.name, "layer": f.where, "detail": f.detail} for r in results for f in r.folded]
    summary.notes += [f"{r.name}: {f.where} left alone: {f.why}" for r in results[1:] for f in r.skipped]
    if not gathers and cfg.head_dtype != "int8" and not tied.folded:
        summary.notes.append("token embedding kept fp32 (" + ("ONNX Runtime's hqq quantizes MatMuls only)"
                             if cfg.algo == "hqq" else "like the fp32 head; ORT quantizes a Gather in int4 only)"))


def quantize_one_node(op: str, w: np.ndarray, cfg: QuantConfig) -> dict[int, onnx.TensorProto]:
    """ONNX Runtime's public quantizer on a graph of one node alone: `op` "MatMul" (x @ w, w [K, N]) or
    "Gather" (rows of the table w [V, d]). Returns input index of the quantized node -> its tensor."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    if op == "Gather":
        node = helper.make_node("Gather", ["W", "ids"], ["y"], name="one")
        x = helper.make_tensor_value_info("ids", TensorProto.INT64, [1])
    else:
        node = helper.make_node("MatMul", ["x", "W"], ["y"], name="one")
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, w.shape[0]])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, w.shape[1]])
    g = helper.make_graph([node], "one", [x], [y], [numpy_helper.from_array(np.ascontiguousarray(w), "W")])
    with quiet_quantizer():
        q = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]),
                                 algo_config=algo_config(cfg, (op,)))
        q.process()
    model = q.model.model
    qnode = next(n for n in model.graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized"))
    inits = {i.name: i for i in model.graph.initializer}
    return {i: inits[name] for i, name in enumerate(qnode.input) if name in inits}


# --- drift against the fp32 graph --------------------------------------------------------------

def logits_diff(ref_runs: list, runs: list) -> tuple[float, float, float]:
    """(max, mean, max |ref|) of |logits - ref logits| over every step of every session."""
    diffs = [np.abs(g[LOGITS].astype(np.float64) - r[LOGITS]) for rs, gs in zip(ref_runs, runs)
             for r, g in zip(rs, gs)]
    refmax = max(float(np.abs(r[LOGITS]).max()) for rs in ref_runs for r in rs)
    return (max(float(d.max()) for d in diffs), float(np.mean([d.mean() for d in diffs])), refmax)
