"""norm_gamma: FlashNorm, fold a real norm's gamma (and beta) into the following linear layers.

FlashNorm (arXiv 2407.09577): W* = diag(gamma) W. Applied to the baseline too, so
that a TaperNorm speedup is never an artefact of a weak baseline. The norm op
stays (it still divides by rms / standardizes); its gamma becomes a constant
vector of ones and its beta is dropped.

Norm ops: ONNX RMSNormalization and LayerNormalization, and ONNX Runtime's
contrib ops that its transformers optimizer writes: SimplifiedLayerNormalization,
SkipLayerNormalization and SkipSimplifiedLayerNormalization (gamma is their third
input; beta the fourth of SkipLayerNormalization, whose fifth, the bias added
before the norm, stays). Only output 0 carries gamma: the mean / inv-std
outputs and the Skip ops' residual sum (output 3) do not depend on it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from graph_passes.base import GraphPass, PassContext, Skip, const_value
from graph_passes.linear_fold import AffineFold, ChannelAffine, fold_affine, tied_embedding, trace_consumers

# op -> (gamma input index, beta input index or None)
NORM_OPS = {
    "RMSNormalization": (1, None),
    "LayerNormalization": (1, 2),
    "SimplifiedLayerNormalization": (1, None),
    "SkipLayerNormalization": (2, 3),
    "SkipSimplifiedLayerNormalization": (2, None),
}


def _optional(node: gs.Node, i: int | None) -> gs.Tensor | None:
    return node.inputs[i] if i is not None and len(node.inputs) > i and node.inputs[i].name else None


def _why_it_stays(ctx: PassContext, node: gs.Node, out: gs.Tensor, skip: Skip) -> Skip:
    """The reason a live norm no matrix follows keeps its gamma, in the words of the 2026 families' norms."""
    leaf = ctx.layer_name(node).rsplit(".", 1)[-1]
    if leaf in ("q_norm", "k_norm"):
        return Skip(f"{node.op} of a QK-norm: the rotary embedding and attention follow, no matrix, and a live "
                    "norm's gamma cannot move past rope (it rotates pairs of dims): gamma stays in the op "
                    "(a TaperNorm at g = 0 folds into W_q / W_k)")
    if any(c.op == "Add" for c in out.outputs):
        return Skip(f"{node.op} output joins the residual stream (a post-sublayer norm), no matrix follows: gamma "
                    "stays in the op (a TaperNorm at g = 0 folds into W_o / W_down)")
    return skip


@dataclass
class GammaFold(AffineFold):
    """AffineFold of a norm op's own gamma/beta; the op stays with gamma = 1, no beta."""
    norm: gs.Node = None


class FoldNormGamma(GraphPass):
    name = "norm_gamma"
    summary = "FlashNorm: fold RMSNorm/LayerNorm (and ORT Skip*LayerNorm) gamma/beta into the following MatMul/Gemm"
    anchors = tuple(NORM_OPS)

    # Pattern (exact):
    #
    #     x ──▶ RMSNormalization(x, gamma, axis=-1)        ──┬──▶ MatMul(W) [▶ Add(b)]
    #     x ──▶ LayerNormalization(x, gamma, beta, axis=-1) ──┤    ... every consumer a MatMul/Gemm
    #     x, skip ──▶ Skip[Simplified]LayerNormalization(x, skip, gamma[, beta, bias]) ──┘ (output 0)
    #           gamma, beta: constant [d]
    #   ==>
    #     x ──▶ Norm(x, ones) ──▶ MatMul(diag(gamma) W) ▶ Add(b + beta W)
    #
    # Left alone: a norm over another axis (axis != -1 and != rank-1), a gamma or
    # beta that is not constant, an output that feeds anything but a linear layer
    # or is a graph output, a norm already at gamma = 1, beta = 0, and a norm that
    # feeds a tied LM head (its weight the token embedding transposed).

    def match(self, ctx: PassContext, node: gs.Node) -> GammaFold | Skip | None:
        g_idx, b_idx = NORM_OPS[node.op]
        if len(node.inputs) <= g_idx or not node.outputs:
            return None
        x, out = node.inputs[0], node.outputs[0]
        axis = node.attrs.get("axis", -1)
        rank = len(x.shape) if x.shape is not None else None
        if axis != -1 and (rank is None or axis != rank - 1):
            return Skip(f"{node.op} over axis {axis}, not the last")
        gamma = const_value(node.inputs[g_idx])
        beta_in = _optional(node, b_idx)
        beta = None if beta_in is None else const_value(beta_in)
        if gamma is None or gamma.ndim != 1 or (beta_in is not None and (beta is None or beta.ndim != 1)):
            return Skip(f"{node.op} gamma/beta not a constant vector")
        if np.all(gamma == 1) and (beta is None or np.all(beta == 0)):
            return None  # nothing to fold
        consumers = trace_consumers(ctx, out, gamma.shape[0])
        if isinstance(consumers, Skip):
            return _why_it_stays(ctx, node, out, consumers)
        # A tied LM head keeps its gamma: the norm op stays either way and applies gamma for free,
        # and an untouched head is still the embedding's table, which export.quantize then stores once.
        tied = next((u.label for u in consumers.linears if tied_embedding(ctx, u)), None)
        if tied:
            return Skip(f"{node.op} feeds {tied}, whose weight is the token embedding's table (tied): gamma stays "
                        "in the norm (no cost: the op applies it anyway), so the table stays one")
        shift = None if beta is None or np.all(beta == 0) else beta
        what = f"{node.op} gamma{'+beta' if shift is not None else ''}"
        return GammaFold(ctx.layer_name(node), out, ChannelAffine(gamma, shift), consumers, what, node)

    def rewrite(self, ctx: PassContext, match: GammaFold) -> None:
        # the norm's output stays the input of its consumers: only the weights change
        fold_affine(ctx, match.x, match.consumers, match.affine)
        node = match.norm
        g_idx, b_idx = NORM_OPS[node.op]
        gamma = const_value(node.inputs[g_idx])
        node.inputs[g_idx] = ctx.const(f"{node.name}.ones", np.ones_like(gamma))
        if b_idx is not None and len(node.inputs) > b_idx:
            if len(node.inputs) == b_idx + 1:
                node.inputs.pop()
            else:                                           # keep the bias after it (SkipLayerNormalization)
                node.inputs[b_idx] = gs.Variable.empty()
