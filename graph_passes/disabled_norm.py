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
import onnx_graphsurgeon as gs

from graph_passes.base import GraphPass, PassContext, Skip, const_value
from graph_passes.linear_fold import AffineFold, ChannelAffine, fold_affine, trace_consumers

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
    anchors = tuple(CENTERING)

    # Pattern (exact up to var(x) / (2 eps)):
    #
    #     x ──▶ LayerNormalization(x, gamma, beta, axis=-1, epsilon >= 1e6) ──┬──▶ MatMul(W) [▶ Add(b)]
    #           gamma, beta: constant [d]                                     ├──▶ Reshape[-1, d] ──▶ Gemm
    #                                                                         └──▶ Shape / Size
    #   ==>
    #     x ──▶ MatMul(C diag(gamma / sqrt(eps)) W) ▶ Add(b + beta W)        (the norm op is gone)
    #
    # RMSNormalization / SimplifiedLayerNormalization: the same without C.
    # Left alone (with a note): a norm over another axis, non-constant gamma or
    # beta, mean / inv-std outputs in use, a consumer that is not a linear layer.

    def match(self, ctx: PassContext, node: gs.Node) -> AffineFold | Skip | None:
        eps = float(node.attrs.get("epsilon", 1e-5))
        if not eps >= DISABLED_NORM_EPS or len(node.inputs) < 2:
            return None
        x, out = node.inputs[0], node.outputs[0]
        what = f"{node.op} (eps {eps:g})"
        axis = node.attrs.get("axis", -1)
        rank = len(x.shape) if x.shape is not None else None
        if axis != -1 and (rank is None or axis != rank - 1):
            return Skip(f"{what} over axis {axis}, not the last")
        if any(o.outputs or ctx.is_graph_output(o) for o in node.outputs[1:]):
            return Skip(f"{what}: its mean/inv-std outputs are used")
        gamma = const_value(node.inputs[1])
        beta_in = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
        beta = None if beta_in is None else const_value(beta_in)
        if gamma is None or gamma.ndim != 1 or (beta_in is not None and (beta is None or beta.ndim != 1)):
            return Skip(f"{what}: gamma/beta not a constant vector")
        consumers = trace_consumers(ctx, out, gamma.shape[0])
        if isinstance(consumers, Skip):
            return Skip(f"{what}: {consumers.why}")
        affine = ChannelAffine(gamma.astype(np.float64) / np.sqrt(eps),
                               None if beta is None else beta.astype(np.float64), CENTERING[node.op])
        return AffineFold(ctx.layer_name(node), x, affine, consumers, f"{what} as {affine.describe()}")

    def rewrite(self, ctx: PassContext, match: AffineFold) -> None:
        fold_affine(ctx, match.x, match.consumers, match.affine)    # the norm loses its consumers: cleanup drops it
