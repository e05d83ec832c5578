"""disabled_norm: a norm whose eps is so large it no longer normalizes, folded away completely.

LN-free GPT-2 checkpoints (FakeLN, Baroni et al. 2025) keep their LayerNorm
modules with eps = 1e12 and a gain scaled up to match (shared/design/METHOD.md,
"More checked facts"). With var(x) << eps,

    LN(x) = (x - mean x) * gamma / sqrt(var x + eps) + beta
          = (x - mean x) * s + beta,     s = gamma / sqrt(eps)

up to a relative error of about var(x) / (2 eps). Centering is linear too,
x - mean x = x C with C = I - 11^T/d, so the whole norm folds into the linear
layers it feeds:  W' = C diag(s) W  (the scaled weight minus its mean over the
input axis), b' = b + beta W. The norm op disappears. RMSNormalization (and ONNX
Runtime's SimplifiedLayerNormalization) with such an eps is x * gamma / sqrt(eps):
the same fold without the centering.
"""
from __future__ import annotations

import numpy as np

from graph_passes.base import GraphPass, PassContext, Rewrite, const_value
from graph_passes.linear_fold import fold_into_linear, match_linear_consumers

# eps at and above which a norm is a fixed linear map; the same threshold as
# models/checkpoint.py DISABLED_NORM_EPS (graph_passes may not import models;
# tests/graph_passes/test_disabled_norm.py checks they agree). At 1e6 the
# approximation error var(x) / (2 eps) is 5e-7 relative for unit-variance
# activations: below fp32 MatMul rounding over a few hundred channels.
DISABLED_NORM_EPS = 1e6
CENTERING = {"LayerNormalization": True, "RMSNormalization": False, "SimplifiedLayerNormalization": False}


class FoldDisabledNorm(GraphPass):
    name = "disabled_norm"
    summary = "fold a norm with eps >= 1e6 (a fixed linear map, LN-free GPT-2) completely into the next MatMul/Gemm"

    # Pattern (exact up to var(x) / (2 eps)):
    #
    #     x ──▶ LayerNormalization(x, gamma, beta, axis=-1, epsilon >= 1e6) ──┬──▶ MatMul(W) [▶ Add(b)]
    #           gamma, beta: constant [d]                                     └──▶ ... every consumer linear
    #   ==>
    #     x ──▶ MatMul(C diag(gamma / sqrt(eps)) W) ▶ Add(b + beta W)        (the norm op is gone)
    #
    # RMSNormalization / SimplifiedLayerNormalization: the same without C.
    # Left alone (with a note): a norm over another axis, non-constant gamma or
    # beta, mean / inv-std outputs in use, a consumer that is not a linear layer.

    def find(self, ctx: PassContext) -> list[Rewrite]:
        rewrites = []
        for node in list(ctx.graph.nodes):
            if node.op not in CENTERING or len(node.inputs) < 2:
                continue
            eps = float(node.attrs.get("epsilon", 1e-5))
            if not eps >= DISABLED_NORM_EPS:
                continue
            label = ctx.layer_name(node)
            x, out = node.inputs[0], node.outputs[0]
            axis = node.attrs.get("axis", -1)
            rank = len(x.shape) if x.shape is not None else None
            if axis != -1 and (rank is None or axis != rank - 1):
                ctx.note(f"{label}: left unfolded: {node.op} (eps {eps:g}) over axis {axis}, not the last")
                continue
            if any(o.outputs for o in node.outputs[1:]):
                ctx.note(f"{label}: left unfolded: {node.op} (eps {eps:g}) mean/inv-std outputs are used")
                continue
            gamma = const_value(node.inputs[1])
            beta_in = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
            beta = None if beta_in is None else const_value(beta_in)
            if gamma is None or gamma.ndim != 1 or (beta_in is not None and (beta is None or beta.ndim != 1)):
                ctx.note(f"{label}: left unfolded: {node.op} (eps {eps:g}) gamma/beta not a constant vector")
                continue
            uses, why = match_linear_consumers(ctx, out, gamma.shape[0])
            if not uses:
                ctx.note(f"{label}: left unfolded: {node.op} (eps {eps:g}): {why}")
                continue
            scale = gamma.astype(np.float64) / np.sqrt(eps)
            center = CENTERING[node.op]
            detail = (f"{node.op} eps {eps:g} as {'centering + ' if center else ''}scale"
                      f"{'+shift' if beta is not None else ''} -> " + ", ".join(u.label for u in uses))
            rewrites.append(Rewrite(label, detail, _folder(ctx, x, uses, scale, beta, center)))
        return rewrites


def _folder(ctx, x, uses, scale, beta, center):
    def apply():
        fold_into_linear(ctx.graph, x, uses, scale, None if beta is None else beta.astype(np.float64), center)
    return apply
