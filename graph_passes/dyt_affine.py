"""dyt_affine: fold DyT's gamma and beta into the following linear layers.

DyT(x) = gamma * tanh(alpha * x) + beta (models/norms.py) is not linear, so the
Tanh stays, but its final per-channel Mul(gamma) and Add(beta) fold exactly as
a norm's do (shared/design/METHOD.md section 2).
"""
from __future__ import annotations

from graph_passes.base import GraphPass, PassContext, Rewrite, producer
from graph_passes.linear_fold import fold_later, match_linear_consumers, match_scale_shift


class FoldDyTAffine(GraphPass):
    name = "dyt_affine"
    summary = "fold DyT gamma/beta (the Mul and Add after its Tanh) into the following MatMul/Gemm weights"

    # Pattern (exact):
    #
    #     x ──▶ Mul(alpha) ──▶ Tanh ──▶ Mul(·, gamma) ──▶ [Add(·, beta)] ──┬──▶ MatMul(W) [▶ Add(b)]
    #                                    gamma, beta: constant [d]          └──▶ ... every consumer linear
    #   ==>
    #     x ──▶ Mul(alpha) ──▶ Tanh ──▶ MatMul(diag(gamma) W) ▶ Add(b + beta W)

    def find(self, ctx: PassContext) -> list[Rewrite]:
        rewrites = []
        for node in list(ctx.graph.nodes):
            if node.op != "Mul":
                continue
            srcs = [producer(t) for t in node.inputs]
            if not any(p is not None and p.op == "Tanh" for p in srcs):
                continue
            label = ctx.layer_name(node)
            m, why = match_scale_shift(ctx, node)
            if m is None or producer(m["x"]) is None or producer(m["x"]).op != "Tanh":
                ctx.note(f"{label}: left unfolded: {why or 'the Tanh output is not the scaled operand'}")
                continue
            uses, why = match_linear_consumers(ctx, m["y"], len(m["scale"]))
            if not uses:
                ctx.note(f"{label}: left unfolded: {why}")
                continue
            detail = f"DyT gamma{'+beta' if m['shift'] is not None else ''} -> " + ", ".join(u.label for u in uses)
            rewrites.append(Rewrite(label, detail, fold_later(ctx, m, uses)))
        return rewrites

