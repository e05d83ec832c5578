"""Shared matching and folding of a per-channel affine map into the linear layers after it.

Not a pass itself: taper_scale, norm_gamma and dyt_affine all end in the same
fold. For a tensor y = x * s + t (s, t per-channel vectors [d] on the last axis)
feeding only linear layers:

    y @ W + b  =  x @ (diag(s) W)  +  (b + t @ W)

    x ──▶ [Mul(s)] ──▶ [Add(t)] ──┬──▶ MatMul(W_q) ──▶ Add(b_q)        x ──┬──▶ MatMul(W_q') ──▶ Add(b_q')
                                  ├──▶ MatMul(W_k) ──▶ Add(b_k)    ==>     ├──▶ MatMul(W_k') ──▶ Add(b_k')
                                  └──▶ Gemm(B, C)                          └──▶ Gemm(B', C')

Every consumer must be a linear layer with a constant 2-D weight taking y as its
data input: MatMul(y, W) with W [in, out] constant or Transpose(constant), or
Gemm(y, B[, C]) with transA = 0. Folded weights and biases are written as NEW
constants (an initializer may be shared: the exporter deduplicates identical
tensors, and a tied LM head shares the embedding), so a node that is not
rewritten keeps seeing the original values.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from graph_passes.base import PassContext, channel_vector, const_value, fresh_name, is_graph_output, producer


@dataclass
class LinearUse:
    node: gs.Node          # the MatMul or Gemm
    weight: np.ndarray     # effective weight [in, out] (a view of the original: never written)
    label: str            # short name for the log ('q_proj', 'lm_head' or the node name)


def _short(ctx: PassContext, node: gs.Node) -> str:
    name = ctx.layer_name(node)
    return name.rsplit(".", 1)[-1] if name != node.name else name


def match_linear(ctx: PassContext, y: gs.Tensor, node: gs.Node) -> tuple[LinearUse | None, str]:
    """`node` as a linear layer consuming y as its data input, or (None, why not)."""
    if node.op == "MatMul":
        if len(node.inputs) != 2 or node.inputs[0] is not y or node.inputs[1] is y:
            return None, f"{node.name} uses it as a MatMul weight, not as the data input"
        w_in = node.inputs[1]
        w = const_value(w_in)
        if w is None:
            src = producer(w_in)
            perm = None if src is None else src.attrs.get("perm")
            if src is not None and src.op == "Transpose" and (perm is None or list(perm) == [1, 0]):
                w = const_value(src.inputs[0])
                w = None if w is None or w.ndim != 2 else w.T
        if w is None or w.ndim != 2 or w.dtype.kind != "f":
            return None, f"{node.name} is a MatMul without a constant 2-D weight"
        return LinearUse(node, w, _short(ctx, node)), ""
    if node.op == "Gemm":
        if node.inputs[0] is not y or any(t is y for t in node.inputs[1:]):
            return None, f"{node.name} uses it as a Gemm weight or bias"
        if node.attrs.get("transA", 0):
            return None, f"{node.name} is a Gemm with transA = 1"
        b = const_value(node.inputs[1])
        if b is None or b.ndim != 2 or b.dtype.kind != "f":
            return None, f"{node.name} is a Gemm without a constant 2-D weight"
        if len(node.inputs) > 2 and node.inputs[2] is not None and const_value(node.inputs[2]) is None \
                and not (isinstance(node.inputs[2], gs.Variable) and node.inputs[2].name == ""):
            return None, f"{node.name} is a Gemm with a non-constant bias"
        w = b.T if node.attrs.get("transB", 0) else b
        return LinearUse(node, w, _short(ctx, node)), ""
    return None, f"{node.name} is a {node.op}, not a MatMul/Gemm"


def match_linear_consumers(ctx: PassContext, y: gs.Tensor, width: int) -> tuple[list[LinearUse], str]:
    """All consumers of y as linear layers with input width `width` (1 = any), or ([], why not)."""
    if is_graph_output(ctx.graph, y):
        return [], f"{y.name} is a graph output"
    if not y.outputs:
        return [], f"{y.name} has no consumers"
    uses = []
    for node in y.outputs:
        use, why = match_linear(ctx, y, node)
        if use is None:
            return [], why
        if width != 1 and use.weight.shape[0] != width:
            return [], f"{node.name} has input width {use.weight.shape[0]}, the scale has {width} channels"
        uses.append(use)
    return uses, ""


def _broadcast_problem(x: gs.Tensor, raw: np.ndarray, vector: np.ndarray) -> str:
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
    last = shape[-1]
    if not isinstance(last, (int, np.integer)):
        return f"the last axis of {x.name} is dynamic ({last}), so the scale's broadcast cannot be proved per-channel"
    if int(last) != len(vector):
        return f"scale of {len(vector)} channels broadcasts {x.name}, whose last axis has {last}: not a per-channel scale"
    return ""


def match_scale_shift(ctx: PassContext, mul: gs.Node) -> tuple[dict | None, str]:
    """Mul(x, s) [-> Add(., t)] with s, t constant per-channel vectors.

        x ──▶ Mul(x, s) ──▶ [Add(·, t)] ──▶ y

    Returns {x, scale, shift, y, nodes} or (None, why not). Either operand
    order is accepted for Mul and Add; the vector must broadcast along the
    last axis only.
    """
    if mul.op != "Mul" or len(mul.inputs) != 2:
        return None, f"{mul.name} is not a two-input Mul"
    a, b = mul.inputs
    va, vb = const_value(a), const_value(b)
    if (va is None) == (vb is None):
        return None, f"{mul.name}: the scale is not a constant" if va is None else f"{mul.name}: both operands are constants"
    x, raw = (b, va) if va is not None else (a, vb)
    scale = channel_vector(raw)
    if scale is None:
        return None, f"{mul.name}: scale of shape {list(raw.shape)} is not per-channel on the last axis"
    why = _broadcast_problem(x, raw, scale)
    if why:
        return None, f"{mul.name}: {why}"
    out = mul.outputs[0]
    nodes, shift = [mul], None
    if len(out.outputs) == 1 and out.outputs[0].op == "Add" and not is_graph_output(ctx.graph, out):
        add = out.outputs[0]
        others = [t for t in add.inputs if t is not out]
        if len(add.inputs) == 2 and len(others) == 1:
            raw_t = const_value(others[0])
            if raw_t is not None:
                shift = channel_vector(raw_t)
                if shift is None:
                    return None, f"{add.name}: shift of shape {list(raw_t.shape)} is not per-channel on the last axis"
                if len(shift) != 1 and len(scale) != 1 and len(shift) != len(scale):
                    return None, f"{add.name}: shift has {len(shift)} channels, the scale {len(scale)}"
                out = add.outputs[0]
                nodes.append(add)
    return {"x": x, "scale": scale, "shift": shift, "y": out, "nodes": nodes}, ""


def _const(graph: gs.Graph, base: str, value: np.ndarray) -> gs.Constant:
    return gs.Constant(fresh_name(graph, base), np.ascontiguousarray(value))


def fold_into_linear(graph: gs.Graph, x: gs.Tensor, uses: list[LinearUse],
                     scale: np.ndarray | None, shift: np.ndarray | None, center: bool = False) -> None:
    """Rewire every use to read x and carry W' = diag(scale) W, b' = b + shift @ W.

    center: x is centered first (x - mean x = x C, C = I - 11^T/d), so
    W' = C diag(scale) W: the scaled weight minus its mean over the input axis.
    Computed in float64 and cast back to the weight's dtype. New constants only.
    """
    for use in uses:
        node, w = use.node, use.weight
        w64 = w.astype(np.float64)
        s = np.ones(w.shape[0]) if scale is None else np.broadcast_to(scale.astype(np.float64), (w.shape[0],))
        w_scaled = s[:, None] * w64                                         # [in, out]
        if center:
            w_scaled = w_scaled - w_scaled.mean(axis=0, keepdims=True)
        w_new = w_scaled.astype(w.dtype)                                    # [in, out]
        delta = None if shift is None else np.broadcast_to(shift.astype(np.float64), (w.shape[0],)) @ w64  # [out]
        base = node.name or "linear"
        if node.op == "MatMul":
            node.inputs[0] = x
            node.inputs[1] = _const(graph, f"{base}.weight", w_new)
            if delta is not None:
                _add_bias(graph, node, delta.astype(w.dtype))
        else:  # Gemm
            trans_b = node.attrs.get("transB", 0)
            node.inputs[0] = x
            node.inputs[1] = _const(graph, f"{base}.weight", w_new.T if trans_b else w_new)
            if delta is not None:
                alpha = float(node.attrs.get("alpha", 1.0))
                beta = float(node.attrs.get("beta", 1.0))
                c_in = node.inputs[2] if len(node.inputs) > 2 else None
                c = None if c_in is None else const_value(c_in)
                if c is None or beta == 0.0:
                    c_new, node.attrs["beta"] = alpha * delta, 1.0
                else:
                    c_new = c.astype(np.float64) + (alpha / beta) * delta
                c_const = _const(graph, f"{base}.bias", np.asarray(c_new).astype(w.dtype))
                if len(node.inputs) > 2:
                    node.inputs[2] = c_const
                else:
                    node.inputs.append(c_const)


def fold_later(ctx: PassContext, match: dict, uses: list[LinearUse]):
    """The deferred apply() of a Rewrite: fold a match_scale_shift result into `uses`
    once every match has been recorded (the graph never changes mid-walk)."""
    def apply():
        shift = match["shift"]
        fold_into_linear(ctx.graph, match["x"], uses, match["scale"].astype(np.float64),
                         None if shift is None else shift.astype(np.float64))
    return apply


def _add_bias(graph: gs.Graph, matmul: gs.Node, delta: np.ndarray) -> None:
    """MatMul ▶ Add(b) becomes MatMul ▶ Add(b + delta); a MatMul without one gets Add(delta)."""
    out = matmul.outputs[0]
    if len(out.outputs) == 1 and out.outputs[0].op == "Add" and not is_graph_output(graph, out):
        add = out.outputs[0]
        others = [(i, t) for i, t in enumerate(add.inputs) if t is not out]
        if len(add.inputs) == 2 and len(others) == 1:
            i, b_in = others[0]
            b = const_value(b_in)
            if b is not None and b.dtype.kind == "f" and b.reshape(-1).shape[0] in (1, delta.shape[0]) \
                    and all(s == 1 for s in b.shape[:-1]):
                b_new = np.broadcast_to(b.reshape(-1).astype(np.float64), delta.shape) + delta
                add.inputs[i] = _const(graph, f"{add.name or 'bias'}.bias", b_new.astype(b.dtype))
                return
    # no bias Add of its own: put one between the MatMul and its consumers
    mid = gs.Variable(fresh_name(graph, out.name), dtype=out.dtype, shape=out.shape)
    matmul.outputs[0] = mid
    graph.nodes.append(gs.Node("Add", name=fresh_name(graph, f"{matmul.name}.bias_add"),
                               inputs=[mid, _const(graph, f"{matmul.name}.bias", delta)], outputs=[out]))
