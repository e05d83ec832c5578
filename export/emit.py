"""The decode-step graph written node by node from the model's spec, its large weights never read.

    emitted = emit_graph(open_weights(DIR), "fp16", attention="fused")
    emitted.proto                  # the unfused decode-step graph (core/contract.py)
    emitted.lazy["blocks.0.attn.q_proj.MatMul.weight"].load()     # one matrix, read when asked for

torch.onnx.export traces the whole model in memory (seconds even for a 1M model, the model's size in
memory for an 8B one). The graph of a decoder is known from its DecoderConfig, the TaperNorm gate and
each norm's c alone, the way ONNX Runtime GenAI's model builder knows it; so this module writes it
directly with onnx.helper, one function per part of the model (embedding, norm, attention, rope,
MLP, head), each the image of the torch code it mirrors (models/decoder.py, norms.py, rope.py,
attention.py, kv_cache.py). The graph is the one export_onnx writes, op for op where numbers are
concerned (so that both compute the same values, and the graph passes fold both alike):

  - every 2-D parameter (Linear weights, the token and position tables, an untied head) is a Lazy
    (graph_passes/lazy.py) whose placeholder stands in the initializers: it reads the source's tensor
    only when the graph is written. A MatMul weight is the read tensor transposed ([in, out], as torch
    writes nn.Linear); a tied head is the embedding's Lazy transposed, so its key tells the passes it
    is the table (`same_values`). 1-D tensors (gains, biases, DyT's alpha) are read now and written
    with their data, as torch's exporter folds them (a TaperNorm at g = 0: the one constant c * w~);
  - every node carries torch's provenance metadata (pkg.torch.onnx.name_scopes / class_hierarchy,
    the module path and class chain read off the skeleton), which the passes use to find TaperNorms
    and to name layers, and every intermediate its shape (value_info), which their checks read;
  - attention is "plain" (MatMul / Mul / Where / Softmax, grouped-query through 5-D views) or "fused"
    (one opset-24 Attention per layer), the two forms of export_onnx, down to the mask and rotary
    structure that graph_passes/ort_attention.py matches;
  - from LIVE_CUT_FROM slots (live_cut), each layer's attention is an If whose branch attends over the
    caches cut to the live slots L = max(position) + T while CUT_BELOW x L <= S_max, and whose other
    branch is the attention above (attend_live): a step then costs its depth, not the capacity. torch's
    export has no such If (tests/export/test_emit.py compares below that capacity, or live_cut=False).

Where it is not torch's graph node for node, no value changes: a tied head is the table's Lazy transposed
(torch writes Transpose(table), which fold_constants then folds); names are module paths
(/blocks.0.attn/MatMul_3), not torch's; a few small nodes torch's optimizer shares (a mask's Not) are
written per layer. A bf16 graph is the fp16 graph with every fp16 type made bf16, its weights kept fp32
through the passes and rounded to bf16 once, folded or not (export.bfloat16.bf16_graph).
tests/export/test_emit.py holds the graph to export_onnx's: the same outputs (fp32 within 1e-6) and the
same pass results, on every model the reference decoder can be.
"""
from __future__ import annotations

import contextlib
import math
import types
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from core.contract import INPUT_IDS, LOGITS, POSITION, cache_name, cache_names, np_dtype, present_name
from core.errors import UserError
from graph_passes.base import CLASS_HIERARCHY, NAME_SCOPES
from graph_passes.lazy import Lazy, transposed
from models.decoder import Decoder, StepInputs
from models.norms import DyT, LayerNorm, RMSNorm, TaperNorm
from models.rope import rope_frequencies

IR_VERSION = 10                  # what torch's exporter writes (ONNX Runtime reads it)
OPSET = 24                       # TensorScatter (the in-place cache write) and the Attention op
# model-level metadata that graph passes and runtimes read back (all values are strings)
META_PREFIX = "tapernorm."
RMSNORM_FORMS = ("op", "naive")  # one RMSNormalization | x * rsqrt(mean(x^2) + eps) * w (a hand-written norm)
DTYPES = ("fp32", "fp16", "bf16")
ATTENTION = ("plain", "fused")
B, T = "batch", "seq"            # the symbolic dims of the contract
L = "live"                       # the slots a step attends to when cut (live_cut): max(position) + T
# From this capacity the portable graph attends over the live slots when that is cheaper: per layer an If on
# CUT_BELOW x L <= S_max, whose branch cuts the caches to their first L slots (a Slice, which ONNX Runtime
# copies) and whose other branch reads the whole cache as below. Under it the cut gains nothing (measured:
# capacity 256 at depth 100 costs the same either way); the GroupQueryAttention graph reads the written slots
# itself. CUT_BELOW: on ONNX Runtime's CPU a cut slot (copied, then read) costs ~2.7x a masked slot of the whole
# cache (docs/export.md, the portable graph's cost against depth), so the cut pays below about a third of S_max.
LIVE_CUT_FROM = 1024
CUT_BELOW = 3
INT64, BOOL = TensorProto.INT64, TensorProto.BOOL
ELEM = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}
# the export wrapper torch's provenance starts with (tests/export/oracle.py's _DecodeStep holding `model`)
WRAPPER_SCOPES, WRAPPER_CLASSES = ["", "model"], ["export.emit.DecodeStep", "models.decoder.Decoder"]


FP16_MAX = float(np.finfo(np.float16).max)      # 65504: a larger finite weight is inf once cast to fp16


class Fp16RangeError(UserError):
    """A weight an fp16 graph would hold as inf (refused where it is made, and where a fold makes it)."""

    def __init__(self, name: str, found: str):
        super().__init__(f"{name}: expected weights within fp16's range (|w| <= {FP16_MAX:g}) for --dtype fp16, "
                         f"found {found}; build with --dtype fp32 or --dtype bf16")


@dataclass
class Emitted:
    proto: onnx.ModelProto          # the unfused decode-step graph; matrices as Lazy placeholders
    lazy: dict[str, Lazy]           # placeholder initializer name -> its Lazy
    # bf16: the float constants that are fp32 by design (rope frequencies); the graph is the fp16 one with its
    # weights still fp32, made bf16 after the passes by export.bfloat16.bf16_graph (each weight rounded once)
    fp32: frozenset = frozenset()


def model_metadata(model: Decoder, dtype: str) -> dict[str, str]:
    """The graph's model-level metadata (tapernorm.*): what graph passes and runtimes read back."""
    cfg = model.cfg
    meta = {"norm": cfg.norm, "taper_scope": str(cfg.taper_scope), "dtype": dtype,
            "n_layer": str(cfg.n_layer), "n_head": str(cfg.n_head), "n_kv_head": str(cfg.kv_heads),
            "head_dim": str(cfg.head_dim), "pos_embedding": cfg.pos_embedding,
            "capacity": str(cfg.max_seq_len), "vocab_size": str(cfg.vocab_size),
            "tie_embeddings": str(cfg.tie_embeddings).lower()}
    if cfg.norm == "taper":
        meta["gate"] = repr(model.gate.value)
        meta["taper_layers"] = ",".join(model.taper_layers())
    return {META_PREFIX + k: v for k, v in meta.items()}


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class _Graph:
    """Nodes, initializers and value_info being written, with the module the next nodes belong to."""

    def __init__(self, source, dtype: str, rmsnorm: str = "op"):
        self.source, self.model, self.cfg = source, source.skeleton, source.cfg
        self.target, self.rmsnorm = dtype, rmsnorm                 # the dtype asked for (the matrices' keys); RMSNorm's form
        self.dtype = "fp16" if dtype == "bf16" else dtype          # the nodes': a bf16 graph is fp16 retyped after
        self.np, self.elem = np_dtype(self.dtype), ELEM[self.dtype]
        # the weights' and float constants' dtype while the graph is made: a bf16 graph keeps them fp32 until
        # after the passes (export.bfloat16.bf16_graph), so that each is rounded to bf16 once, folded or not
        self.weights = np.dtype(np.float32) if dtype == "bf16" else np.dtype(self.np)
        self.fp32: set[str] = set()                                # constants fp32 by design (bf16: kept so)
        self.nodes, self.inits, self.value_info, self.lazy = [], [], [], {}
        self.path, self._count, self._consts, self._provenance = "", {}, {}, {}
        self.shapes: dict = {}            # Reshape targets by their dims, and the batch / step lengths: made once
        self.rope_heads: dict = {}        # (cos, sin) [B, T, rd] -> [B, 1, T, rd] in the graph's dtype: made once
        self.table: Lazy | None = None    # the token embedding (a tied head is its transpose)
        self.live_cut = False             # attention over the live slots (LIVE_CUT_FROM): set by emit_graph
        self.live: tuple[str, str] = ("", "")    # (CUT_BELOW L <= S_max: bool [], L: int64 [1]): step_inputs
        self.live_masks: dict[str, str] = {}     # a layer's mask -> the same over the first L slots
        self.in_branch = False            # nodes go to an If's branch (branch()): constants are Constant nodes

    @contextlib.contextmanager
    def branch(self):
        """The nodes written inside go to a subgraph of their own (an If's branch): yields a namespace that
        holds them (.nodes, .value_info) on exit. What they make is not reused outside (Reshape targets, rope
        heads), and a constant made inside is a Constant node inside, not an initializer."""
        saved = (self.nodes, self.value_info, dict(self.shapes), dict(self.rope_heads), self.in_branch)
        body = types.SimpleNamespace()
        self.nodes, self.value_info, self.in_branch = [], [], True
        try:
            yield body
        finally:
            body.nodes, body.value_info = self.nodes, self.value_info
            self.nodes, self.value_info, self.shapes, self.rope_heads, self.in_branch = saved

    @contextlib.contextmanager
    def module(self, path: str):
        """The nodes written inside belong to module `path` (blocks.0.ln_1; '' is the Decoder)."""
        before, self.path = self.path, path
        try:
            yield
        finally:
            self.path = before

    def _meta(self, op_type: str, leaf: str) -> list:
        """torch's provenance of a node of the current module: the module call stack and its classes."""
        if self.path not in self._provenance:
            scopes, classes = list(WRAPPER_SCOPES), list(WRAPPER_CLASSES)
            parts = self.path.split(".") if self.path else []
            for i in range(1, len(parts) + 1):
                sub = ".".join(parts[:i])
                m = self.model.get_submodule(sub)
                if not isinstance(m, nn.ModuleList):        # a ModuleList is never called: no scope
                    scopes.append(f"model.{sub}")
                    classes.append(_qualname(type(m)))
            self._provenance[self.path] = (scopes, classes)
        scopes, classes = self._provenance[self.path]
        return [onnx.StringStringEntryProto(key=NAME_SCOPES, value=repr(scopes + [leaf])),
                onnx.StringStringEntryProto(key=CLASS_HIERARCHY,
                                            value=repr(classes + [f"aten.{op_type.lower()}.default"]))]

    def node(self, op_type: str, inputs, outputs, **attrs) -> list[str]:
        """One node of the current module; outputs: (name or None, shape, elem type or None = the graph's)."""
        k = self._count[op_type] = self._count.get(op_type, -1) + 1
        name = f"/{self.path or 'model'}/{op_type}_{k}"
        out_names = []
        for j, (out, shape, elem) in enumerate(outputs):
            if out is None:
                out = name if len(outputs) == 1 else f"{name}:{j}"
                self.value_info.append(helper.make_tensor_value_info(out, self.elem if elem is None else elem, shape))
            out_names.append(out)
        node = helper.make_node(op_type, list(inputs), out_names, name=name, **attrs)
        node.metadata_props.extend(self._meta(op_type, f"{op_type.lower()}_{k}"))
        self.nodes.append(node)
        return out_names

    def op(self, op_type: str, *inputs: str, shape, elem=None, out=None, **attrs) -> str:
        return self.node(op_type, inputs, [(out, shape, elem)], **attrs)[0]

    def const(self, value, dtype=None, name: str | None = None) -> str:
        """An initializer holding `value` (the graph's float type unless dtype); small ones written once. In an
        fp16 graph a finite weight past fp16's range is refused in one line naming it (it would be inf)."""
        exact, by_design = value, dtype is not None and np.dtype(dtype) == np.float32 and self.dtype != "fp32"
        with np.errstate(over="ignore" if self.target == "fp16" else "warn"):     # (fp16: refused below instead)
            value = np.asarray(value, dtype=self.weights if dtype is None else dtype)
        if dtype is None and self.target == "fp16" and not np.isfinite(value).all():
            exact = np.abs(np.asarray(exact, np.float64))
            if np.isfinite(exact).all():            # (a mask's -inf is meant)
                raise Fp16RangeError(name or "a constant", f"max |w| {exact.max():g}")
        if self.in_branch:              # an If's branch: its own Constant node (no outer initializer to rename)
            if self.target == "bf16" and dtype is None:     # rounded to bf16 once now, held in the fp16 the nodes
                # have until bf16_graph (exact in fp16's normal range: a branch's constants are scales, caps, -inf)
                value = value.astype(np_dtype("bf16")).astype(np.float16)
            return self.op("Constant", shape=list(value.shape), elem=helper.np_dtype_to_tensor_dtype(value.dtype),
                           value=numpy_helper.from_array(value))
        key = (by_design, value.dtype.str, value.shape, value.tobytes()) if value.size <= 16 and name is None else None
        if key in self._consts:
            return self._consts[key]
        name = name or f"const_{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(value, name))
        if by_design:
            self.fp32.add(name)
        if key is not None:
            self._consts[key] = name
        return name

    def param(self, name: str) -> np.ndarray:
        """A 1-D (or 0-D) parameter read now, fp32 (e.g. blocks.0.ln_1.weight)."""
        return self.source.tensor(name).numpy().astype(np.float32)

    def vector(self, name: str) -> str:
        """A 1-D (or 0-D) parameter as an initializer of the graph's float type, its data written."""
        return self.const(self.param(name), name=name)

    def matrix(self, param: str, group: int) -> Lazy:
        """A 2-D parameter as torch stores it ([out, in], a table [rows, d]), read only when written."""
        shape = tuple(self.model.get_parameter(param).shape)
        source, dtype = self.source, self.weights
        return Lazy(shape, dtype, lambda: source.tensor(param).numpy().astype(dtype, copy=False),
                    key=(param, self.target), group=group)

    def placeholder(self, name: str, lazy: Lazy) -> str:
        t = lazy.tensor
        t.name = name
        self.inits.append(t)
        self.lazy[name] = lazy
        return name

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, np.int64), np.int64)


# --- the parts of the model, as models/decoder.py computes them ------------------------------------

def _shape(g: _Graph, *dims) -> str:
    """A Reshape target: the batch and step lengths read from input_ids ("B", "T"), the rest numbers."""
    if dims not in g.shapes:
        with g.module(""):
            parts = [_batch_and_len(g)[0] if d == "B" else _batch_and_len(g)[1] if d == "T" else g.ints(d)
                     for d in dims]
            g.shapes[dims] = g.op("Concat", *parts, shape=[len(dims)], elem=INT64, axis=0)
    return g.shapes[dims]


def _batch_and_len(g: _Graph) -> tuple[str, str]:
    """Shape(input_ids)[0:1], [1:2]: int64 [1] each."""
    if "lengths" not in g.shapes:
        with g.module(""):
            g.shapes["lengths"] = (g.op("Shape", INPUT_IDS, shape=[1], elem=INT64, start=0, end=1),
                                   g.op("Shape", INPUT_IDS, shape=[1], elem=INT64, start=1, end=2))
    return g.shapes["lengths"]


def step_inputs(g: _Graph) -> StepInputs:
    """models/decoder.py's step_inputs with a cache: positions, masks, rope tables (tensor names)."""
    cfg, S = g.cfg, g.cfg.max_seq_len
    with g.module(""):
        seq = g.op("Squeeze", _batch_and_len(g)[1], g.ints(0), shape=[], elem=INT64)
        steps = g.op("Range", g.const(0, np.int64), seq, g.const(1, np.int64), shape=[T], elem=INT64)
        pos_ids = g.op("Add", g.op("Unsqueeze", POSITION, g.ints(1), shape=[B, 1], elem=INT64),
                       g.op("Unsqueeze", steps, g.ints(0), shape=[1, T], elem=INT64), shape=[B, T], elem=INT64)
        keys = g.const(np.arange(S, dtype=np.int64)[None, None, :], np.int64)                # [1, 1, S]
        query = g.op("Unsqueeze", pos_ids, g.ints(2), shape=[B, T, 1], elem=INT64)          # pos_ids[:, :, None]
        mask = g.op("Unsqueeze", g.op("LessOrEqual", keys, query, shape=[B, T, S], elem=BOOL), g.ints(1),
                    shape=[B, 1, T, S], elem=BOOL)                                          # key j <= position
        sliding = None
        if cfg.sliding_layers:     # and j > position - window
            after = g.op("Greater", keys, g.op("Sub", query, g.const(cfg.sliding_window, np.int64), shape=[B, T, 1],
                                               elem=INT64), shape=[B, T, S], elem=BOOL)
            sliding = g.op("And", mask, g.op("Unsqueeze", after, g.ints(1), shape=[B, 1, T, S], elem=BOOL),
                           shape=[B, 1, T, S], elem=BOOL)
        if g.live_cut:
            live = g.op("Add", g.op("ReduceMax", POSITION, shape=[], elem=INT64, keepdims=0), seq, shape=[], elem=INT64)
            cheaper = g.op("LessOrEqual", g.op("Mul", live, g.const(CUT_BELOW, np.int64), shape=[], elem=INT64),
                           g.const(S, np.int64), shape=[], elem=BOOL)          # the cut copies L slots, reads L
            end = g.op("Unsqueeze", live, g.ints(0), shape=[1], elem=INT64)
            g.live = (cheaper, end)
            g.live_masks = {m: g.op("Slice", m, g.ints(0), end, g.ints(3), shape=[B, 1, T, L], elem=BOOL)
                            for m in (mask, sliding) if m is not None}
    rotaries = g.model.rotaries()
    used = {cfg.rope_kind(i) for i in range(cfg.n_layer)} - {None}
    ropes = {k: rope_tables(g, k, rotaries[k], pos_ids, query) for k in sorted(used)}
    return StepInputs(cfg, pos_ids, mask, sliding, ropes)    # its layer(i) picks each layer's mask and rope


def rope_tables(g: _Graph, kind: str, rotary, pos_ids: str, query: str) -> tuple[str, str]:
    """cos, sin [B, T, rotary_dim] of RotaryEmbedding.forward: fp32 angles whatever the graph's dtype."""
    inv_freq, long_inv_freq, _, _ = rope_frequencies(rotary.theta, rotary.dim, rotary.scaling)
    half = [B, T, rotary.dim // 2]

    def table(freqs):       # the model's buffer in its dtype (an fp16 model holds fp16 frequencies; bf16 keeps
        return g.const(freqs.numpy().astype(g.weights).astype(np.float32), np.float32)      # fp32 ones), read as fp32
    with g.module("rotary" if kind == "global" else "rotary_local"):
        freqs = table(inv_freq)
        if rotary.switch_after is not None:     # longrope: the long set once this call reaches past the switch
            last = g.op("Add", g.op("ReduceMax", pos_ids, shape=[], elem=INT64, keepdims=0, noop_with_empty_axes=0),
                        g.const(1, np.int64), shape=[], elem=INT64)
            freqs = g.op("Where", g.op("Greater", last, g.const(rotary.switch_after, np.int64), shape=[], elem=BOOL),
                         table(long_inv_freq), freqs, shape=[rotary.dim // 2], elem=TensorProto.FLOAT)
        angles = g.op("Mul", g.op("Cast", query, shape=[B, T, 1], elem=TensorProto.FLOAT, to=TensorProto.FLOAT),
                      freqs, shape=half, elem=TensorProto.FLOAT)                           # [B, T, rotary_dim / 2]
        emb = g.op("Concat", angles, angles, shape=[B, T, rotary.dim], elem=TensorProto.FLOAT, axis=-1)
        cos_sin = [g.op(trig, emb, shape=[B, T, rotary.dim], elem=TensorProto.FLOAT) for trig in ("Cos", "Sin")]
        if rotary.attention_scaling != 1.0:     # yarn, longrope
            scale = g.const(rotary.attention_scaling, np.float32)
            cos_sin = [g.op("Mul", t, scale, shape=[B, T, rotary.dim], elem=TensorProto.FLOAT) for t in cos_sin]
    return tuple(cos_sin)


def embed(g: _Graph, pos_ids: str) -> str:
    """Token embeddings [B, T, d] (times embed_scale), plus the learned position's row."""
    cfg, d = g.cfg, g.cfg.d_model
    with g.module("wte"):
        g.table = g.matrix("wte.weight", -1)                                             # [V, d]
        x = g.op("Gather", g.placeholder("wte.weight", g.table), INPUT_IDS, shape=[B, T, d], axis=0)
    with g.module(""):
        if cfg.embed_scale != 1.0:
            x = g.op("Mul", x, g.const(cfg.embed_scale), shape=[B, T, d])
    if cfg.pos_embedding == "learned":
        with g.module("wpe"):
            rows = g.op("Gather", g.placeholder("wpe.weight", g.matrix("wpe.weight", -1)), pos_ids, shape=[B, T, d],
                        axis=0)
        with g.module(""):
            x = g.op("Add", x, rows, shape=[B, T, d])
    return x


def norm(g: _Graph, name: str, x: str, shape: list) -> str:
    """The norm module `name` (models/norms.py) applied over the last axis of x."""
    m, eps = g.model.get_submodule(name), g.cfg.eps_of(name)
    with g.module(name):
        if isinstance(m, RMSNorm):
            return _rms_norm(g, name, x, shape, eps)
        if isinstance(m, LayerNorm):
            return _layer_norm(g, name, x, shape, eps, bias=True)
        if isinstance(m, DyT):          # weight * tanh(alpha * x) + bias
            y = g.op("Tanh", g.op("Mul", g.vector(f"{name}.alpha"), x, shape=shape), shape=shape)
            return g.op("Add", g.op("Mul", g.vector(f"{name}.weight"), y, shape=shape), g.vector(f"{name}.bias"),
                        shape=shape)
        assert isinstance(m, TaperNorm), f"{name}: {type(m).__name__} is no norm models/norms.py has"
        return _taper(g, name, m, x, shape)


def _rms_norm(g: _Graph, name: str, x: str, shape: list, eps: float) -> str:
    """F.rms_norm: one RMSNormalization (opset 23+); naive: x * 1 / sqrt(mean(x^2) + eps) * w, separate ops
    (Pow / ReduceMean / Add / Sqrt / Reciprocal / Mul / Mul, as torch exports a hand-written one)."""
    w = g.vector(f"{name}.weight")
    if g.rmsnorm == "op" or name.endswith(("q_norm", "k_norm")):
        return g.op("RMSNormalization", x, w, shape=shape, axis=-1, epsilon=eps, stash_type=1)
    stat = shape[:-1] + [1]
    mean = g.op("ReduceMean", g.op("Pow", x, g.const(2.0), shape=shape), g.ints(-1), shape=stat, keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean, g.const(eps), shape=stat), shape=stat), shape=stat)
    return g.op("Mul", g.op("Mul", x, inv, shape=shape), w, shape=shape)


def _layer_norm(g: _Graph, name: str, x: str, shape: list, eps: float, bias: bool) -> str:
    inputs = [x, g.vector(f"{name}.weight")] + ([g.vector(f"{name}.bias")] if bias else [])
    return g.op("LayerNormalization", *inputs, shape=shape, axis=-1, epsilon=eps, stash_type=1)


def _taper(g: _Graph, name: str, m: TaperNorm, x: str, shape: list) -> str:
    """g * N(h) gamma [+ beta] + (1 - g) (h (c gamma~) [+ beta~]); at g = 0 only the linear branch, one Mul
    by the constant c * gamma~ computed in the graph's dtype (as torch's exporter folds it)."""
    gate = m.gate.value

    def normalized():
        if m.base == "ln":
            return _layer_norm(g, name, x, shape, m.eps, bias=m.affine)
        y = _rms_norm(g, name, x, shape, m.eps)
        return g.op("Add", y, g.vector(f"{name}.bias"), shape=shape) if m.affine else y

    def linear():
        scale = g.param(f"{name}.weight_tilde").astype(g.weights) * g.weights.type(m.c)      # [d], c * gamma~
        y = g.op("Mul", x, g.const(scale, name=f"{name}.scale"), shape=shape)
        return g.op("Add", y, g.vector(f"{name}.bias_tilde"), shape=shape) if m.affine else y
    if gate == 0.0:
        return linear()
    if gate == 1.0:
        return normalized()
    y = g.op("Mul", normalized(), g.const(gate), shape=shape)
    return g.op("Add", y, g.op("Mul", linear(), g.const(1.0 - gate), shape=shape), shape=shape)


def linear(g: _Graph, module: str, x: str, shape: list, group: int) -> str:
    """nn.Linear: MatMul(x, W^T) [+ bias]; W^T a Lazy [in, out]."""
    lazy = transposed(g.matrix(f"{module}.weight", group))
    out = shape[:-1] + [lazy.shape[1]]
    with g.module(module):
        y = g.op("MatMul", x, g.placeholder(f"{module}.MatMul.weight", lazy), shape=out)
        if g.model.get_submodule(module).bias is not None:
            y = g.op("Add", y, g.vector(f"{module}.bias"), shape=out)
    return y


def attention(g: _Graph, i: int, x: str, mask: str, rope, attn_form: str) -> str:
    """models/decoder.py's Attention.forward with the cache: project, split heads, rope, write, attend."""
    cfg, prefix = g.cfg, f"blocks.{i}.attn"
    H, Hkv, D, S = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.max_seq_len
    q = linear(g, f"{prefix}.q_proj", x, [B, T, cfg.d_model], i)                        # [B, T, H * D]
    k = linear(g, f"{prefix}.k_proj", x, [B, T, cfg.d_model], i)                        # [B, T, H_kv * D]
    if cfg.qk_norm == "proj":                                                           # over the whole projection
        q, k = norm(g, f"{prefix}.q_norm", q, [B, T, H * D]), norm(g, f"{prefix}.k_norm", k, [B, T, Hkv * D])
    per_head = cfg.qk_norm == "head"
    q = split_heads(g, prefix, q, H, f"{prefix}.q_norm" if per_head else None)         # [B, H, T, D]
    k = split_heads(g, prefix, k, Hkv, f"{prefix}.k_norm" if per_head else None)       # [B, H_kv, T, D]
    v = split_heads(g, prefix, linear(g, f"{prefix}.v_proj", x, [B, T, cfg.d_model], i), Hkv, None)
    if rope is not None:
        q, k = apply_rope(g, prefix, q, H, rope), apply_rope(g, prefix, k, Hkv, rope)
    with g.module(prefix):      # the cache write: one TensorScatter per cache, in place (models/kv_cache.py)
        k, v = (g.op("TensorScatter", cache_name(i, kind), t, POSITION, shape=[B, Hkv, S, D],
                     out=present_name(cache_name(i, kind)), axis=-2, mode="linear")
                for kind, t in (("key", k), ("value", v)))
        attend = attend_fused if attn_form == "fused" else attend_plain
        if g.live_cut:
            y = attend_live(g, attend, q, k, v, mask)
        else:
            y = attend(g, q, k, v, mask, S)
        y = g.op("Transpose", y, shape=[B, T, H, D], perm=[0, 2, 1, 3])
        y = g.op("Reshape", y, _shape(g, "B", "T", H * D), shape=[B, T, H * D], allowzero=1)
    return linear(g, f"{prefix}.out_proj", y, [B, T, H * D], i)


def split_heads(g: _Graph, prefix: str, x: str, n: int, head_norm: str | None) -> str:
    """[B, T, n * D] -> [B, n, T, D], a per-head norm over D on the way (Qwen3, Gemma 3)."""
    D = g.cfg.head_dim
    with g.module(prefix):
        x = g.op("Reshape", x, _shape(g, "B", "T", n, D), shape=[B, T, n, D], allowzero=1)
    if head_norm is not None:
        x = norm(g, head_norm, x, [B, T, n, D])
    with g.module(prefix):
        return g.op("Transpose", x, shape=[B, n, T, D], perm=[0, 2, 1, 3])


def apply_rope(g: _Graph, prefix: str, x: str, n: int, rope: tuple[str, str]) -> str:
    """models/rope.py's apply_rope: x [B, n, T, D] rotated on its first rotary_dim dims, rotate-half layout."""
    D, rd = g.cfg.head_dim, g.cfg.rotary_dim or g.cfg.head_dim
    with g.module(prefix):
        if rope not in g.rope_heads:      # cos, sin [B, 1, T, rd] in the graph's dtype (torch's exporter: once)
            heads = [g.op("Unsqueeze", t, g.ints(1), shape=[B, 1, T, rd], elem=TensorProto.FLOAT) for t in rope]
            if g.dtype != "fp32":
                heads = [g.op("Cast", t, shape=[B, 1, T, rd], to=g.elem) for t in heads]
            g.rope_heads[rope] = heads
        cos, sin = g.rope_heads[rope]
        rot = x
        if rd != D:
            rot = g.op("Slice", x, g.ints(0), g.ints(rd), g.ints(3), g.ints(1), shape=[B, n, T, rd])
            rest = g.op("Slice", x, g.ints(rd), g.ints(np.iinfo(np.int64).max), g.ints(3), g.ints(1),
                        shape=[B, n, T, D - rd])
        x1, x2 = g.node("Split", [rot], [(None, [B, n, T, rd // 2], None)] * 2, axis=3, num_outputs=2)
        half = g.op("Concat", g.op("Neg", x2, shape=[B, n, T, rd // 2]), x1, shape=[B, n, T, rd], axis=-1)
        y = g.op("Add", g.op("Mul", rot, cos, shape=[B, n, T, rd]), g.op("Mul", half, sin, shape=[B, n, T, rd]),
                 shape=[B, n, T, rd])
        return y if rd == D else g.op("Concat", y, rest, shape=[B, n, T, D], axis=-1)


def attend_live(g: _Graph, attend, q: str, k: str, v: str, mask: str) -> str:
    """attend() over the live slots when that is cheaper: If(CUT_BELOW L <= S_max) then the caches and mask cut
    to their first L slots, else the whole cache (the Slice copies what it keeps: past a third of the capacity
    the copy costs more than the masked slots it saves; measured in docs/export.md)."""
    cfg = g.cfg
    H, Hkv, D, group = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.n_head // cfg.kv_heads
    if group > 1 and attend is attend_plain:     # its Reshape targets, made once outside both branches
        _shape(g, "B", Hkv, group, "T", D)
        _shape(g, "B", H, "T", D)
    cheaper, end = g.live
    outputs = []
    for which in ("cut", "whole"):
        with g.branch() as body:
            if which == "cut":
                kk, vv = (g.op("Slice", t, g.ints(0), end, g.ints(2), shape=[B, Hkv, L, D]) for t in (k, v))
                out = attend(g, q, kk, vv, g.live_masks[mask], L)
            else:
                out = attend(g, q, k, v, mask, cfg.max_seq_len)
        outputs.append(helper.make_graph(body.nodes, f"{g.path}.{which}", [],
                                         [helper.make_tensor_value_info(out, g.elem, [B, H, T, D])],
                                         value_info=[v for v in body.value_info if v.name != out]))
    return g.op("If", cheaper, shape=[B, H, T, D], then_branch=outputs[0], else_branch=outputs[1])


def attend_fused(g: _Graph, q: str, k: str, v: str, mask: str, S=None) -> str:
    """One opset-24 Attention (tests/export/oracle.py's attention_onnx): scale and softcap as attributes (S, the
    slots k and v hold, as attend_plain takes it: the op reads them off its inputs)."""
    cfg = g.cfg
    attrs = {"is_causal": 0, "qk_matmul_output_mode": 0, "softcap": float(cfg.attn_softcap or 0.0)}
    if cfg.attn_scale is not None:
        attrs["scale"] = float(cfg.attn_scale)
    return g.op("Attention", q, k, v, mask, shape=[B, cfg.n_head, T, cfg.head_dim], **attrs)


def attend_plain(g: _Graph, q: str, k: str, v: str, mask: str, S) -> str:
    """models/attention.py's attend_plain: softmax(cap(q k^T * scale) where mask) v -> [B, H, T, D]; with
    grouped-query attention q is viewed [B, H_kv, G, T, D] and k, v, mask get a group axis (no copies).
    S: the slots k, v and mask hold (the capacity, or L cut)."""
    cfg = g.cfg
    H, Hkv, D = cfg.n_head, cfg.kv_heads, cfg.head_dim
    group, lead = H // Hkv, [B, Hkv, H // Hkv] if H != Hkv else [B, H]
    if group > 1:
        q = g.op("Reshape", q, _shape(g, "B", Hkv, group, "T", D), shape=[*lead, T, D], allowzero=1)
        k, v = (g.op("Unsqueeze", t, g.ints(2), shape=[B, Hkv, 1, S, D]) for t in (k, v))
        mask = g.op("Unsqueeze", mask, g.ints(1), shape=[B, 1, 1, T, S], elem=BOOL)
    perm = [0, 1, 2, 4, 3] if group > 1 else [0, 1, 3, 2]
    kt = g.op("Transpose", k, shape=[B, Hkv, 1, D, S] if group > 1 else [B, H, D, S], perm=perm)
    scores = g.op("MatMul", q, kt, shape=[*lead, T, S])
    scores = g.op("Mul", scores, g.const(1.0 / math.sqrt(D) if cfg.attn_scale is None else cfg.attn_scale),
                  shape=[*lead, T, S])
    if cfg.attn_softcap:        # before the mask, as transformers' Gemma 2 does
        cap = g.const(cfg.attn_softcap)
        scores = g.op("Mul", g.op("Tanh", g.op("Div", scores, cap, shape=[*lead, T, S]), shape=[*lead, T, S]), cap,
                      shape=[*lead, T, S])
    hidden = g.op("Not", mask, shape=[B, 1, 1, T, S] if group > 1 else [B, 1, T, S], elem=BOOL)
    scores = g.op("Where", hidden, g.const(-np.inf), scores, shape=[*lead, T, S])
    y = g.op("MatMul", g.op("Softmax", scores, shape=[*lead, T, S], axis=-1), v, shape=[*lead, T, D])
    if group > 1:
        y = g.op("Reshape", y, _shape(g, "B", H, "T", D), shape=[B, H, T, D], allowzero=1)
    return y


def mlp(g: _Graph, i: int, x: str) -> str:
    """down(act(up x)), or down(act(gate x) * up x) for swiglu."""
    cfg, prefix, d = g.cfg, f"blocks.{i}.mlp", g.cfg.d_model
    hidden = [B, T, cfg.hidden]

    def act(y):
        with g.module(prefix):
            if cfg.act == "silu":
                return g.op("Mul", y, g.op("Sigmoid", y, shape=hidden), shape=hidden)
            if cfg.act == "relu":
                return g.op("Relu", y, shape=hidden)
            return g.op("Gelu", y, shape=hidden, approximate="tanh" if cfg.act == "gelu_new" else "none")
    if cfg.mlp == "swiglu":
        gated = act(linear(g, f"{prefix}.gate_proj", x, [B, T, d], i))
        up = linear(g, f"{prefix}.up_proj", x, [B, T, d], i)
        with g.module(prefix):
            y = g.op("Mul", gated, up, shape=hidden)
    else:
        y = act(linear(g, f"{prefix}.up_proj", x, [B, T, d], i))
    return linear(g, f"{prefix}.down_proj", y, hidden, i)


def block(g: _Graph, i: int, x: str, steps: StepInputs, attn_form: str) -> str:
    """x + r * post(attn(pre(x))), then the same with the MLP (models/decoder.py's Block)."""
    names, d = set(g.cfg.block_norms()), [B, T, g.cfg.d_model]
    mask, rope = steps.layer(i)

    def residual(x, y, post):
        if post in names:
            y = norm(g, f"blocks.{i}.{post}", y, d)
        with g.module(f"blocks.{i}"):
            if g.cfg.residual_scale != 1.0:
                y = g.op("Mul", y, g.const(g.cfg.residual_scale), shape=d)
            return g.op("Add", x, y, shape=d)
    a = attention(g, i, norm(g, f"blocks.{i}.ln_1", x, d) if "ln_1" in names else x, mask, rope, attn_form)
    x = residual(x, a, "post_attn_norm")
    m = mlp(g, i, norm(g, f"blocks.{i}.ln_2", x, d) if "ln_2" in names else x)
    return residual(x, m, "post_mlp_norm")


def head(g: _Graph, x: str) -> str:
    """Final norm, LM head (a tied one: the embedding's table transposed), divisor and soft-cap -> logits."""
    cfg = g.cfg
    if cfg.final_norm:
        x = norm(g, "ln_f", x, [B, T, cfg.d_model])
    weight = transposed(g.table if cfg.tie_embeddings else g.matrix("lm_head.weight", -1))         # [d, V]
    logits = [B, T, cfg.vocab_size]
    with g.module("lm_head"):
        y = g.op("MatMul", x, g.placeholder("lm_head.MatMul.weight", weight), shape=logits)
    with g.module(""):
        if cfg.logits_divisor != 1.0:
            y = g.op("Div", y, g.const(cfg.logits_divisor), shape=logits)
        if cfg.final_softcap is not None:
            cap = g.const(cfg.final_softcap)
            y = g.op("Mul", g.op("Tanh", g.op("Div", y, cap, shape=logits), shape=logits), cap, shape=logits)
    last = g.nodes[-1]                  # the logits' producer writes the graph output itself
    assert last.output[0] == y
    last.output[0] = LOGITS
    g.value_info = [v for v in g.value_info if v.name != y]
    return LOGITS


# --- the graph ------------------------------------------------------------------------------------

def emit_graph(source, dtype: str = "fp32", attention: str = "plain", rmsnorm: str = "op",
               live_cut: bool | None = None) -> Emitted:
    """The decode-step graph of `source` (.cfg, .skeleton with gate and c set, .tensor(name)); no 2-D
    tensor is read (each is a Lazy in Emitted.lazy). attention: "plain" | "fused" (export_onnx's forms).
    rmsnorm: "op" (one RMSNormalization, the strongest baseline) | "naive" (its arithmetic as
    separate ops, what a hand-written RMSNorm exports as: bench's rmsnorm-plain). live_cut: attend over the
    live slots when cheaper (attend_live; None: from a capacity of LIVE_CUT_FROM; a graph for
    ONNX Runtime's GroupQueryAttention passes False: that op reads the written slots itself)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {', '.join(DTYPES)}")
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r}; expected one of {', '.join(ATTENTION)}")
    if rmsnorm not in RMSNORM_FORMS:
        raise ValueError(f"rmsnorm {rmsnorm!r}; expected one of {', '.join(RMSNORM_FORMS)}")
    cfg = source.cfg
    g = _Graph(source, dtype, rmsnorm)
    g.live_cut = live_cut if live_cut is not None else cfg.max_seq_len >= LIVE_CUT_FROM
    steps = step_inputs(g)
    x = embed(g, steps.pos_ids)
    for i in range(cfg.n_layer):
        x = block(g, i, x, steps, attention)
    head(g, x)
    Hkv, S, D = cfg.kv_heads, cfg.max_seq_len, cfg.head_dim
    caches = cache_names(cfg.n_layer)
    inputs = [helper.make_tensor_value_info(INPUT_IDS, INT64, [B, T]),
              helper.make_tensor_value_info(POSITION, INT64, [B]),
              *(helper.make_tensor_value_info(c, g.elem, [B, Hkv, S, D]) for c in caches)]
    outputs = [helper.make_tensor_value_info(LOGITS, g.elem, [B, T, cfg.vocab_size]),
               *(helper.make_tensor_value_info(present_name(c), g.elem, [B, Hkv, S, D]) for c in caches)]
    graph = helper.make_graph(g.nodes, "main_graph", inputs, outputs, g.inits, value_info=g.value_info)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="tapernorm.export.emit")
    for k, v in {**model_metadata(source.skeleton, dtype), META_PREFIX + "attention": attention}.items():
        proto.metadata_props.add(key=k, value=v)
    return Emitted(proto, g.lazy, frozenset(g.fp32) if dtype == "bf16" else frozenset())
