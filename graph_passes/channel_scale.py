"""channel_scale: fold the per-channel gain (and shift) of any norm into the following linear layers.

A norm's gain is a Mul by a constant per-channel vector, whatever made it:
torch's exporter writes HF's RMSNorm as Pow / ReduceMean / Add / Sqrt /
Reciprocal / Mul followed by Mul(gamma) (the "exploded" RMSNorm, with provenance
LlamaRMSNorm, Qwen2RMSNorm, ...), a user's own norm class alike, and a graph
from another exporter carries no provenance at all. Folding y = x * s (+ t) into
the linear layers that consume y is exact whatever the Mul came from, so the
candidates are the Muls by a constant (not x * 1/rms inside the norm) whose provenance names a norm class (any
class with "Norm" in its name, TaperNorm excepted: that one is taper_scale's) or
that carry no provenance. A Mul fed by a Tanh is DyT's gamma (dyt_affine's).

Candidates that look like a norm gain (a norm by provenance, the exploded
RMSNorm / LayerNorm pattern, or a vector of more than one channel) and cannot be
folded get a note; a scalar Mul of some other computation (GELU's 0.5) is not a
candidate and stays silent.
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from graph_passes.base import GraphPass, PassContext, Skip, const_value, producer
from graph_passes.linear_fold import AffineFold, ChannelAffine, fold_affine, match_scale_shift, trace_consumers
from graph_passes.taper_scale import is_taper_node

# ops that may sit between the mean of squares and the Mul that applies 1/rms
_RMS_CHAIN = ("Add", "Sqrt", "Reciprocal", "Div", "Cast", "Pow")


def norm_class(ctx: PassContext, node: gs.Node) -> str | None:
    """The innermost module class naming a norm ('LlamaRMSNorm'), '' when the node has no provenance,
    None when its provenance names no norm."""
    classes = ctx.module_class(node)
    if not classes:
        return ""
    norms = [c.rsplit(".", 1)[-1] for c in classes if "norm" in c.rsplit(".", 1)[-1].lower()]
    return norms[-1] if norms else None


def _square_mean_of(t: gs.Tensor, steps: int = 6) -> gs.Tensor | None:
    """h when t is computed from ReduceMean(Pow(h, 2) | Mul(h, h)) through eps / sqrt / reciprocal steps."""
    for _ in range(steps):
        p = producer(t)
        if p is None:
            return None
        if p.op == "ReduceMean":
            sq = producer(p.inputs[0])
            if sq is None:
                return None
            if sq.op == "Pow" and (v := const_value(sq.inputs[1])) is not None and v.size == 1 and float(v) == 2.0:
                return sq.inputs[0]
            if sq.op == "Mul" and sq.inputs[0] is sq.inputs[1]:
                return sq.inputs[0]
            return None
        if p.op not in _RMS_CHAIN:
            return None
        # follow the non-constant input (Add(var, eps), Div(1, sqrt), Pow(var, -0.5))
        dyn = [i for i in p.inputs if const_value(i) is None]
        if len(dyn) != 1:
            return None
        t = dyn[0]
    return None


def exploded_norm(x: gs.Tensor) -> str | None:
    """'RMSNorm' / 'LayerNorm' when x is h * 1/rms(h) (resp. the centered form) computed op by op."""
    p = producer(x)
    if p is None or p.op not in ("Mul", "Div") or len(p.inputs) != 2:
        return None
    pairs = [(p.inputs[0], p.inputs[1])] + ([(p.inputs[1], p.inputs[0])] if p.op == "Mul" else [])
    for h, r in pairs:
        if _square_mean_of(r) is h:
            src = producer(h)
            centered = src is not None and src.op == "Sub" and producer(src.inputs[1]) is not None \
                and producer(src.inputs[1]).op == "ReduceMean"
            return "LayerNorm" if centered else "RMSNorm"
    return None


class FoldChannelScale(GraphPass):
    name = "channel_scale"
    summary = "fold any norm's per-channel gain/shift (exploded RMSNorm, HF norms, no provenance) into MatMul/Gemm"
    anchors = ("Mul",)

    # Pattern (exact; anything else is left alone, with a note when it looks like a norm gain):
    #
    #     h ─▶ Pow(2) ─▶ ReduceMean ─▶ Add(eps) ─▶ Sqrt ─▶ Reciprocal ─┐         (the exploded RMSNorm, or any x)
    #     h ───────────────────────────────────────────────────────────┴▶ Mul ─▶ x
    #     x ──▶ Mul(x, gamma) ──▶ [Add(·, beta)] ──┬──▶ MatMul(W) [▶ Add(b)]
    #           gamma, beta: constant [d]          ├──▶ Reshape[-1, d] ──▶ Gemm   (reshapes keeping the last axis)
    #                                              └──▶ Shape / Size              (read x's shape instead)
    #   ==>
    #     x ──▶ MatMul(diag(gamma) W) ▶ Add(b + beta W)

    def match(self, ctx: PassContext, node: gs.Node) -> AffineFold | Skip | None:
        if is_taper_node(ctx, node):
            return None                                   # taper_scale's
        if any(producer(t) is not None and producer(t).op == "Tanh" for t in node.inputs):
            return None                                   # DyT's gamma: dyt_affine's
        cls = norm_class(ctx, node)
        if cls is None:
            return None                                   # provenance names no norm
        data = [t for t in node.inputs if const_value(t) is None]
        if len(data) != 1 or len(node.inputs) != 2:
            return None                                   # not a Mul by a constant (x * 1/rms, gate * up)
        pattern = exploded_norm(data[0])
        scale = [const_value(t) for t in node.inputs if t is not data[0]]
        vector = scale[0].size > 1
        looks_like_norm = bool(cls) or pattern is not None or vector
        m = match_scale_shift(ctx, node)
        if isinstance(m, Skip):
            return m if looks_like_norm else None
        consumers = trace_consumers(ctx, m.y, len(m.scale))
        if isinstance(consumers, Skip):
            return consumers if looks_like_norm else None
        what = f"{cls or (pattern + ' (exploded)' if pattern else 'channel')} " \
               f"{'gamma+beta' if m.shift is not None else 'gamma'}"
        return AffineFold(ctx.layer_name(node), m.x, ChannelAffine(m.scale, m.shift), consumers, what)

    def rewrite(self, ctx: PassContext, match: AffineFold) -> None:
        fold_affine(ctx, match.x, match.consumers, match.affine)
