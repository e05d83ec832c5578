"""Shared matching and folding of a per-channel affine map into the linear layers after it.

Not a pass itself: every folding pass ends in the same fold. For a tensor
y = (x [C]) * s + t (s, t per-channel vectors [d] on the last axis; C the
optional centering I - 11^T/d of a disabled LayerNorm) feeding only linear layers:

    y @ W + b  =  x @ (C diag(s) W)  +  (b + t @ W)

    x ──▶ [Mul(s)] ──▶ [Add(t)] ──┬──▶ MatMul(W_q) ──▶ Add(b_q)               x ──┬──▶ MatMul(W_q') ──▶ Add(b_q')
                                  ├──▶ Reshape[-1, d] ──▶ Gemm(B, C)    ==>       ├──▶ Reshape[-1, d] ──▶ Gemm(B', C')
                                  └──▶ Shape                                      └──▶ Shape

What the consumers of y may be (`trace_consumers`, anything else stops the fold
with one line saying which node and why):
- a linear layer with a constant 2-D weight taking y as its data input:
  MatMul(y, W) with W [in, out] constant or Transpose(constant), or Gemm(y, B[, C])
  with transA = 0;
- a reshape that keeps the last axis (Reshape, Flatten, Squeeze, Unsqueeze,
  Identity whose input and output both end in d): it only regroups whole
  channel rows, so the scale rides through it (GPT-2's Conv1D exports as
  Reshape -> Gemm -> Reshape; ln_f feeds a view before the head); its own
  consumers must pass the same test;
- Shape / Size: they read only the shape, which x shares (the broadcast check
  proved y has x's shape), so they read x instead.

Folded weights and biases are written as NEW constants (an initializer may be
shared: the exporter deduplicates identical tensors, and a tied LM head shares
the embedding), so a node that is not rewritten keeps seeing the original values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from graph_passes.base import (Match, PassContext, Skip, channel_vector, const_value, is_float, producer,
                               static_last_dim)
from graph_passes.lazy import combine, digest, lazy_map, same_values, transposed

RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")
SHAPE_READERS = ("Shape", "Size")


@dataclass
class LinearUse:
    node: gs.Node          # the MatMul or Gemm
    weight: np.ndarray     # effective weight [in, out] (a view of the original, or its Lazy: never written)
    label: str             # short name for the log ('q_proj', 'lm_head' or the node name)


@dataclass
class Consumers:
    """Every use of a scaled tensor y, seen through reshapes that keep the last axis."""
    y: gs.Tensor
    linears: list[LinearUse] = field(default_factory=list)
    direct: list[gs.Node] = field(default_factory=list)       # nodes reading y itself: they read x after the fold
    through: list[gs.Node] = field(default_factory=list)      # channel-keeping reshapes on the way
    shape_only: list[gs.Node] = field(default_factory=list)   # Shape / Size consumers

    def labels(self) -> str:
        via = f" (via {len(self.through)} reshape(s))" if self.through else ""
        return ", ".join(u.label for u in self.linears) + via


@dataclass(frozen=True)
class ChannelAffine:
    """y = (x [C]) * scale + shift over the last axis; float64 vectors [d] (or [1]); center: x - mean x first."""
    scale: np.ndarray | None
    shift: np.ndarray | None = None
    center: bool = False

    def describe(self) -> str:
        parts = (["centering"] if self.center else []) + (["scale"] if self.scale is not None else []) + \
                (["shift"] if self.shift is not None else [])
        return "+".join(parts)


@dataclass
class AffineFold(Match):
    """A per-channel affine map on x, folded into every linear layer that consumes its output."""
    x: gs.Tensor
    affine: ChannelAffine
    consumers: Consumers
    what: str = ""                    # e.g. 'RMSNorm (exploded) gamma'

    @property
    def detail(self) -> str:
        return f"{self.what or self.affine.describe()} -> {self.consumers.labels()}"


def short_label(ctx: PassContext, node: gs.Node) -> str:
    name = ctx.layer_name(node)
    return name.rsplit(".", 1)[-1] if name != node.name else name


def linear_weight(node: gs.Node):
    """The effective weight [in, out] a MatMul (constant, or Transpose of a constant) or Gemm holds now
    (an array, or the Lazy of a weight computed when written), or None. Rewrites read it again rather than
    what their match saw: two folds may rewrite one matrix (a pre-norm into W_q's rows, a QK-norm into its
    columns)."""
    if node.op == "Gemm":
        b = const_value(node.inputs[1])
        return None if b is None else (transposed(b) if node.attrs.get("transB", 0) else b)
    w_in = node.inputs[1]
    w = const_value(w_in)
    if w is None:
        src = producer(w_in)
        perm = None if src is None else src.attrs.get("perm")
        if src is not None and src.op == "Transpose" and (perm is None or list(perm) == [1, 0]):
            w = const_value(src.inputs[0])
            w = None if w is None or w.ndim != 2 else transposed(w)
    return w


def match_linear(ctx: PassContext, y: gs.Tensor, node: gs.Node) -> LinearUse | Skip:
    """`node` as a linear layer consuming y as its data input, or Skip(why not)."""
    if node.op == "MatMul":
        if len(node.inputs) != 2 or node.inputs[0] is not y or node.inputs[1] is y:
            return Skip(f"{node.name} uses it as a MatMul weight, not as the data input")
        w = linear_weight(node)
        if w is None or w.ndim != 2 or not is_float(w.dtype):
            return Skip(f"{node.name} is a MatMul without a constant 2-D weight")
        return LinearUse(node, w, short_label(ctx, node))
    if node.op == "Gemm":
        if node.inputs[0] is not y or any(t is y for t in node.inputs[1:]):
            return Skip(f"{node.name} uses it as a Gemm weight or bias")
        if node.attrs.get("transA", 0):
            return Skip(f"{node.name} is a Gemm with transA = 1")
        b = const_value(node.inputs[1])
        if b is None or b.ndim != 2 or not is_float(b.dtype):
            return Skip(f"{node.name} is a Gemm without a constant 2-D weight")
        if len(node.inputs) > 2 and node.inputs[2].name and const_value(node.inputs[2]) is None:
            return Skip(f"{node.name} is a Gemm with a non-constant bias")
        w = transposed(b) if node.attrs.get("transB", 0) else b
        return LinearUse(node, w, short_label(ctx, node))
    return Skip(f"{node.name} is a {node.op}, not a MatMul/Gemm")


def _keeps_last_axis(node: gs.Node, width: int) -> str:
    """Why `node` (a reshape-like op) might move the channel axis, or "" when it provably keeps it."""
    out = node.outputs[0]
    if width == 1:
        return ""                      # one scale for every element: any regrouping keeps it
    last = static_last_dim(out)
    if last is None and node.op == "Reshape" and len(node.inputs) > 1:
        last = _last_entry(node.inputs[1])
    if last is None:
        return f"{node.name} ({node.op}) has an output whose last axis is not known statically"
    if last != width:
        return f"{node.name} ({node.op}) moves the channel axis: its output ends in {last}, not {width} channels"
    return ""


def _last_entry(shape: gs.Tensor, depth: int = 4) -> int | None:
    """The last entry of a Reshape's target shape when it is a known positive number.

    The shape may be computed, as exporters write views: Concat(batch, seq, Unsqueeze(d))
    with d a constant or Gather(Shape(z), -1) of a z whose last axis is static.
    """
    value = const_value(shape)
    if value is not None:
        value = value.reshape(-1)
        return int(value[-1]) if value.size and value.dtype.kind in "iu" and value[-1] > 0 else None
    src = producer(shape)
    if src is None or depth == 0:
        return None
    if src.op == "Concat" and src.inputs:
        return _last_entry(src.inputs[-1], depth - 1)
    if src.op in ("Unsqueeze", "Cast", "Identity", "Reshape"):
        return _last_entry(src.inputs[0], depth - 1)
    if src.op == "Gather" and len(src.inputs) == 2:
        index, shape_of = const_value(src.inputs[1]), producer(src.inputs[0])
        if index is not None and index.size == 1 and shape_of is not None and shape_of.op == "Shape" \
                and not shape_of.attrs.get("start") and shape_of.attrs.get("end") is None:
            z = shape_of.inputs[0]
            rank = len(z.shape) if z.shape is not None else None
            if rank and int(index.reshape(-1)[0]) in (-1, rank - 1):
                return static_last_dim(z)
    return None


def tied_embedding(ctx: PassContext, use: LinearUse) -> str | None:
    """The embedding table that `use`'s weight is the transpose of (a tied LM head: a row Gather
    from a constant [V, d] whose transpose is the weight [d, V]), or None."""
    w = use.weight
    for node in ctx.graph.nodes:
        if node.op != "Gather" or node.attrs.get("axis", 0) != 0 or len(node.inputs) != 2:
            continue
        table = const_value(node.inputs[0])
        if table is not None and table.shape == w.shape[::-1] and same_values(table, transposed(w)):
            return node.inputs[0].name
    return None


def trace_consumers(ctx: PassContext, y: gs.Tensor, width: int) -> Consumers | Skip:
    """Every consumer of y as a linear layer of input width `width` (1 = any), through
    channel-keeping reshapes and past Shape/Size readers; or Skip(why not)."""
    if not y.outputs:
        return Skip(f"{y.name} has no consumers")
    found = Consumers(y)
    todo = [y]
    while todo:
        t = todo.pop(0)
        if ctx.is_graph_output(t):
            return Skip(f"{t.name} is a graph output")
        for node in t.outputs:
            if not ctx.owns(node):
                return Skip(f"{node.name} ({node.op}) reads it from inside a subgraph")
            if t is y:
                found.direct.append(node)
            if node.op in SHAPE_READERS:
                found.shape_only.append(node)
                continue
            if node.op in RESHAPES:
                if node.inputs[0] is not t or any(i is t for i in node.inputs[1:]):
                    return Skip(f"{node.name} ({node.op}) reads it as a shape, not as data")
                why = _keeps_last_axis(node, width)
                if why:
                    return Skip(why)
                found.through.append(node)
                todo.append(node.outputs[0])
                continue
            use = match_linear(ctx, t, node)
            if isinstance(use, Skip):
                return use
            if width != 1 and use.weight.shape[0] != width:
                return Skip(f"{node.name} has input width {use.weight.shape[0]}, the scale has {width} channels")
            found.linears.append(use)
    if not found.linears:
        return Skip(f"{y.name} feeds no linear layer")
    return found


def broadcast_problem(x: gs.Tensor, raw: np.ndarray, vector: np.ndarray) -> str:
    """Why x * raw is not provably x scaled per channel (same shape as x), or "".

    The product must keep x's shape: the constant may not add axes (rank <= x's) and
    its length must be 1 or x's last axis, known statically. x[B, 1] * s[4] has shape
    [B, 4]: folding s into the next weight would drop that broadcast.
    """
    shape = x.shape
    if len(vector) == 1 and raw.ndim <= 1:
        return ""
    if shape is None or len(shape) == 0:
        return f"the shape of {x.name} is unknown, so the scale's broadcast cannot be proved per-channel"
    if raw.ndim > len(shape):
        return f"scale of rank {raw.ndim} broadcasts {x.name} of rank {len(shape)} to a higher rank"
    last = static_last_dim(x)
    if last is None:
        return f"the last axis of {x.name} is dynamic ({shape[-1]}), so the scale's broadcast cannot be proved per-channel"
    if last != len(vector):
        return f"scale of {len(vector)} channels broadcasts {x.name}, whose last axis has {last}: not a per-channel scale"
    return ""


@dataclass
class ScaleShift:
    """x ──▶ Mul(x, s) ──▶ [Add(·, t)] ──▶ y, with s, t constant per-channel vectors."""
    mul: gs.Node
    x: gs.Tensor
    scale: np.ndarray                    # [d] or [1], the graph's dtype
    shift: np.ndarray | None
    y: gs.Tensor
    add: gs.Node | None = None


def match_scale_shift(ctx: PassContext, mul: gs.Node, with_shift: bool = True) -> ScaleShift | Skip:
    """Mul(x, s) [-> Add(., t)] with s, t constant per-channel vectors, either operand order.

    The vector must broadcast along the last axis only and keep x's shape. The
    Add is taken when it is the Mul's only consumer and adds a constant.
    """
    if mul.op != "Mul" or len(mul.inputs) != 2:
        return Skip(f"{mul.name} is not a two-input Mul")
    a, b = mul.inputs
    va, vb = const_value(a), const_value(b)
    if (va is None) == (vb is None):
        return Skip(f"{mul.name}: the scale is not a constant" if va is None else f"{mul.name}: both operands are constants")
    x, raw = (b, va) if va is not None else (a, vb)
    scale = channel_vector(raw)
    if scale is None:
        return Skip(f"{mul.name}: scale of shape {list(raw.shape)} is not per-channel on the last axis")
    why = broadcast_problem(x, raw, scale)
    if why:
        return Skip(f"{mul.name}: {why}")
    out = mul.outputs[0]
    match = ScaleShift(mul, x, scale, None, out)
    if not with_shift or len(out.outputs) != 1 or out.outputs[0].op != "Add" or ctx.is_graph_output(out):
        return match
    add = out.outputs[0]
    others = [t for t in add.inputs if t is not out]
    if len(add.inputs) != 2 or len(others) != 1:
        return match
    raw_t = const_value(others[0])
    if raw_t is None:
        return match
    shift = channel_vector(raw_t)
    if shift is None or broadcast_problem(x, raw_t, shift):
        return Skip(f"{add.name}: shift of shape {list(raw_t.shape)} is not per-channel on the last axis")
    match.shift, match.y, match.add = shift, add.outputs[0], add
    return match


def fold_affine(ctx: PassContext, x: gs.Tensor, consumers: Consumers, affine: ChannelAffine) -> None:
    """Rewire every direct consumer of y to read x; every linear layer carries
    W' = C diag(scale) W and b' = b + shift @ W. Float64, cast back to the weight's dtype."""
    for use in consumers.linears:
        _fold_weight(ctx, use, affine)
    for node in consumers.direct:
        for i, t in enumerate(node.inputs):
            if t is consumers.y:
                node.inputs[i] = x


def _fold_weight(ctx: PassContext, use: LinearUse, affine: ChannelAffine) -> None:
    """W' = C diag(scale) W and, with a shift, b' = b + shift @ W (float64, cast back to W's dtype), as new
    constants: computed now for an array, when written for a Lazy (graph_passes/lazy.py)."""
    node, w = use.node, linear_weight(use.node)
    rows, dtype = w.shape[0], w.dtype
    s = np.ones(rows) if affine.scale is None else np.broadcast_to(affine.scale.astype(np.float64), (rows,))

    def fold(a: np.ndarray) -> np.ndarray:
        out = np.multiply(a, s[:, None], dtype=np.float64)                  # [in, out], in a's layout
        if affine.center:                                                  # C diag(s) W
            out -= out.mean(axis=0, keepdims=True)
        return out.astype(dtype)
    w_new = lazy_map(w, fold, tag=("rows", digest(s), affine.center))
    delta = None
    if affine.shift is not None:
        shift = np.broadcast_to(affine.shift.astype(np.float64), (rows,))
        delta = lazy_map(w, lambda a: shift @ a.astype(np.float64), (w.shape[1],), np.float64,
                         tag=("shift@", digest(shift)))                    # [out]
    base = node.name or "linear"
    if node.op == "MatMul":
        node.inputs[1] = ctx.const(f"{base}.weight", w_new)
        if delta is not None:
            _add_bias(ctx, node, lazy_map(delta, lambda d: d.astype(dtype), dtype=dtype, tag=("as", str(dtype))))
        return
    trans_b = node.attrs.get("transB", 0)                                  # Gemm
    node.inputs[1] = ctx.const(f"{base}.weight", transposed(w_new) if trans_b else w_new)
    if delta is not None:
        alpha = float(node.attrs.get("alpha", 1.0))
        beta = float(node.attrs.get("beta", 1.0))
        c_in = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
        c = None if c_in is None else const_value(c_in)
        if c is None or beta == 0.0:
            c_new, node.attrs["beta"] = lazy_map(delta, lambda d: (alpha * d).astype(dtype), dtype=dtype,
                                                 tag=("times", alpha, str(dtype))), 1.0
        else:
            c_new = plus(c, delta, alpha / beta, dtype)
        c_const = ctx.const(f"{base}.bias", c_new)
        if len(node.inputs) > 2:
            node.inputs[2] = c_const
        else:
            node.inputs.append(c_const)


def plus(b, delta, times: float, dtype):
    """b + times * delta in float64, cast to dtype (either may be a Lazy: then computed when written)."""
    return combine([b, delta], lambda x, y: np.asarray(np.asarray(x, np.float64) + times * y).astype(dtype),
                   np.broadcast_shapes(tuple(b.shape), tuple(delta.shape)), dtype, ("plus", times, str(dtype)))


def _add_bias(ctx: PassContext, matmul: gs.Node, delta) -> None:
    """MatMul ▶ Add(b) becomes MatMul ▶ Add(b + delta); a MatMul without one gets Add(delta)."""
    out = matmul.outputs[0]
    if len(out.outputs) == 1 and out.outputs[0].op == "Add" and not ctx.is_graph_output(out):
        add = out.outputs[0]
        others = [(i, t) for i, t in enumerate(add.inputs) if t is not out]
        if len(add.inputs) == 2 and len(others) == 1:
            i, b_in = others[0]
            b = const_value(b_in)
            if b is not None and is_float(b.dtype) and int(np.prod(b.shape)) in (1, delta.shape[0]) \
                    and all(s == 1 for s in b.shape[:-1]):
                n = delta.shape[0]
                b_flat = lazy_map(b, lambda a: np.broadcast_to(a.reshape(-1), (n,)), (n,), tag=("flat", n))
                add.inputs[i] = ctx.const(f"{add.name or 'bias'}.bias", plus(b_flat, delta, 1.0, b.dtype))
                return
    # no bias Add of its own: put one between the MatMul and its consumers
    mid = gs.Variable(ctx.fresh_name(out.name), dtype=out.dtype, shape=out.shape)
    matmul.outputs[0] = mid
    ctx.graph.nodes.append(gs.Node("Add", name=ctx.fresh_name(f"{matmul.name}.bias_add"),
                                   inputs=[mid, ctx.const(f"{matmul.name}.bias", delta)], outputs=[out]))
