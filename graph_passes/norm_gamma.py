"""norm_gamma: FlashNorm, fold a real norm's gamma (and beta) into the following linear layers.

FlashNorm (arXiv 2407.09577): W* = diag(gamma) W. Applied to the baseline too, so
that a TaperNorm speedup is never an artefact of a weak baseline. The norm op
stays (it still divides by rms / standardizes); its gamma becomes a constant
vector of ones and its beta is dropped.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from graph_passes.base import GraphPass, PassContext, Rewrite, const_value, fresh_name
from graph_passes.linear_fold import fold_into_linear, match_linear_consumers

NORM_OPS = ("RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization")


class FoldNormGamma(GraphPass):
    name = "norm_gamma"
    summary = "FlashNorm: fold RMSNorm/LayerNorm gamma (and beta) into the following MatMul/Gemm weights"

    # Pattern (exact):
    #
    #     x ──▶ RMSNormalization(x, gamma, axis=-1)        ──┬──▶ MatMul(W) [▶ Add(b)]
    #     x ──▶ LayerNormalization(x, gamma, beta, axis=-1) ──┘    ... every consumer a MatMul/Gemm
    #           gamma, beta: constant [d]
    #   ==>
    #     x ──▶ Norm(x, ones) ──▶ MatMul(diag(gamma) W) ▶ Add(b + beta W)
    #
    # Left alone: a norm over another axis (axis != -1 and != rank-1), a gamma or
    # beta that is not constant, an output that feeds anything but a linear layer
    # or is a graph output, and a norm already at gamma = 1, beta = 0.

    def find(self, ctx: PassContext) -> list[Rewrite]:
        rewrites = []
        for node in list(ctx.graph.nodes):
            if node.op not in NORM_OPS or len(node.inputs) < 2 or len(node.outputs) < 1:
                continue
            label = ctx.layer_name(node)
            x, out = node.inputs[0], node.outputs[0]
            axis = node.attrs.get("axis", -1)
            rank = len(x.shape) if x.shape is not None else None
            if axis != -1 and (rank is None or axis != rank - 1):
                ctx.note(f"{label}: left unfolded: {node.op} over axis {axis}, not the last")
                continue
            if any(o.outputs for o in node.outputs[1:]):
                ctx.note(f"{label}: left unfolded: mean/inv-std outputs are used")
                continue
            gamma = const_value(node.inputs[1])
            beta_in = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
            beta = None if beta_in is None else const_value(beta_in)
            if gamma is None or gamma.ndim != 1 or (beta_in is not None and (beta is None or beta.ndim != 1)):
                ctx.note(f"{label}: left unfolded: gamma/beta not a constant vector")
                continue
            if np.all(gamma == 1) and (beta is None or np.all(beta == 0)):
                continue  # nothing to fold
            uses, why = match_linear_consumers(ctx, out, gamma.shape[0])
            if not uses:
                ctx.note(f"{label}: left unfolded: {why}")
                continue
            shift = None if beta is None or np.all(beta == 0) else beta
            detail = f"{node.op} gamma{'+beta' if shift is not None else ''} -> " + ", ".join(u.label for u in uses)
            rewrites.append(Rewrite(label, detail, _folder(ctx, node, gamma, shift, uses)))
        return rewrites


def _folder(ctx, node, gamma, beta, uses):
    def apply():
        fold_into_linear(ctx.graph, node.outputs[0], uses, gamma.astype(np.float64),
                         None if beta is None else beta.astype(np.float64))
        ones = gs.Constant(fresh_name(ctx.graph, f"{node.name}.ones"), np.ones_like(gamma))
        node.inputs[1] = ones
        while len(node.inputs) > 2:
            node.inputs.pop()
    return apply
