"""dyt_affine: fold DyT's gamma and beta into the following linear layers.

DyT(x) = gamma * tanh(alpha * x) + beta (models/norms.py) is not linear, so the
Tanh stays, but its final per-channel Mul(gamma) and Add(beta) fold exactly as
a norm's do (shared/design/METHOD.md section 2).
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from graph_passes.base import GraphPass, PassContext, Skip, producer
from graph_passes.linear_fold import AffineFold, ChannelAffine, fold_affine, match_scale_shift, trace_consumers


class FoldDyTAffine(GraphPass):
    name = "dyt_affine"
    summary = "fold DyT gamma/beta (the Mul and Add after its Tanh) into the following MatMul/Gemm weights"
    anchors = ("Mul",)

    # Pattern (exact):
    #
    #     x ──▶ Mul(alpha) ──▶ Tanh ──▶ Mul(·, gamma) ──▶ [Add(·, beta)] ──┬──▶ MatMul(W) [▶ Add(b)]
    #                                    gamma, beta: constant [d]          └──▶ ... every consumer linear
    #   ==>
    #     x ──▶ Mul(alpha) ──▶ Tanh ──▶ MatMul(diag(gamma) W) ▶ Add(b + beta W)

    def match(self, ctx: PassContext, node: gs.Node) -> AffineFold | Skip | None:
        if not any(producer(t) is not None and producer(t).op == "Tanh" for t in node.inputs):
            return None
        m = match_scale_shift(ctx, node)
        if isinstance(m, Skip):
            return m
        if producer(m.x) is None or producer(m.x).op != "Tanh":
            return Skip("the Tanh output is not the scaled operand")
        consumers = trace_consumers(ctx, m.y, len(m.scale))
        if isinstance(consumers, Skip):
            return consumers
        what = f"DyT gamma{'+beta' if m.shift is not None else ''}"
        return AffineFold(ctx.layer_name(node), m.x, ChannelAffine(m.scale, m.shift), consumers, what)

    def rewrite(self, ctx: PassContext, match: AffineFold) -> None:
        fold_affine(ctx, match.x, match.consumers, match.affine)
