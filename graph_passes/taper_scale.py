"""taper_scale: fold a g = 0 TaperNorm (a per-channel scale, and a shift for the affine variant).

At g = 0 a TaperNorm is h -> h * (c * gamma_tilde) [+ beta_tilde] (models/norms.py),
exported as one Mul by a constant vector (and one Add). A pre-norm folds into every
linear layer it feeds (graph_passes/linear_fold.py): Q, K, V (or fused QKV), MLP up
(and gate), and, with All-Taper, the LM head (cloned first when it is tied to the
embedding). A norm that no matrix follows folds into the matrix before it instead
(graph_passes/output_fold.py): a QK-norm (per head, before the rotary embedding) into
the output columns of W_q / W_k of every head, a post-sublayer norm (Gemma 2/3, OLMo 2)
into those of W_o / W_down.

Which Muls are TaperNorms: nodes whose torch provenance (node metadata
pkg.torch.onnx.class_hierarchy) names models.norms.TaperNorm. Per-channel Muls
of other norms (or of graphs without provenance) are channel_scale's. The gate
comes from the model metadata tapernorm.gate: a TaperNorm graph whose gate is
not 0 still has its normalized branch, and the pass refuses it with one line.
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from graph_passes.base import GraphPass, PassContext, PassError, Skip
from graph_passes.linear_fold import AffineFold, ChannelAffine, fold_affine, match_scale_shift, trace_consumers
from graph_passes.output_fold import OutputFold, fold_into_producer, trace_producer

TAPER_CLASS = "TaperNorm"


def is_taper_node(ctx: PassContext, node: gs.Node) -> bool:
    return any(c.rsplit(".", 1)[-1] == TAPER_CLASS for c in ctx.module_class(node))


def taper_layers(ctx: PassContext) -> dict[str, list[str]]:
    """Layer name -> op types of the nodes the exporter attributed to a TaperNorm."""
    layers: dict[str, list[str]] = {}
    for graph in ctx.graphs():
        for node in graph.nodes:
            if is_taper_node(ctx, node):
                layers.setdefault(ctx.layer_name(node), []).append(node.op)
    return layers


def detect_taper(ctx: PassContext) -> dict:
    """{'layers': {name: [ops]}, 'gate': float | None, 'foldable': bool} from graph and metadata."""
    layers = taper_layers(ctx)
    gate = ctx.meta_gate()
    declared = [n for n in ctx.model_meta.get("tapernorm.taper_layers", "").split(",") if n]
    for name in declared:
        layers.setdefault(name, [])
    blend = {n for n, ops in layers.items()
             if any(op in ("RMSNormalization", "LayerNormalization", "ReduceMean", "Sqrt") for op in ops)}
    foldable = (gate is None or gate == 0.0) and not blend
    return {"layers": layers, "gate": gate, "foldable": foldable, "blend": sorted(blend)}


class FoldTaperScale(GraphPass):
    name = "taper_scale"
    summary = "fold g=0 TaperNorm scales (and affine shifts) into the following MatMul/Gemm weights"
    anchors = ("Mul",)

    # Pattern (exact; anything else is left alone with a note):
    #
    #     h ──▶ Mul(h, s) ──▶ [Add(·, beta)] ──┬──▶ MatMul(W_q) [▶ Add(b_q)]
    #           s: constant [d]   beta: [d]     ├──▶ Reshape[-1, d] ──▶ Gemm(W_k)     (reshapes keeping the last axis)
    #           (provenance: TaperNorm)         └──▶ ... every consumer a MatMul/Gemm, constant W [d, out]; Shape/Size
    #   ==>
    #     h ──▶ MatMul(diag(s) W) ▶ Add(b + beta W)     (new constants; Mul and Add removed)
    #
    # or, when no linear layer follows (a QK-norm, a post-sublayer norm):
    #
    #     x ──▶ MatMul(W) [▶ Add(b)] [▶ Reshape [.., H, D]] ──▶ Mul(h, s) ──▶ [Add(·, beta)] ──▶ (rope, residual add)
    #   ==>
    #     x ──▶ MatMul(W diag(S)) ▶ Add(b S + B) [▶ Reshape] ──▶ ...   (S, B: s, beta repeated over the H heads)

    def prepare(self, ctx: PassContext) -> None:
        info = detect_taper(ctx)
        if info["layers"] and not info["foldable"]:
            names = ", ".join(sorted(info["layers"]))
            gate = info["gate"] if info["gate"] is not None else "above 0 (normalized branch present)"
            raise PassError(f"{names}: TaperNorm gate {gate}; folding needs gate 0 "
                            "(finish the taper, or build without --fuse)")

    def match(self, ctx: PassContext, node: gs.Node) -> AffineFold | OutputFold | Skip | None:
        if not is_taper_node(ctx, node):
            return None
        label = ctx.layer_name(node)
        m = match_scale_shift(ctx, node)
        if isinstance(m, Skip):
            return m
        if m.add is not None and ctx.layer_name(m.add) != label:     # an Add of another module: not its shift
            m.shift, m.y, m.add = None, node.outputs[0], None
        affine = ChannelAffine(m.scale, m.shift)
        consumers = trace_consumers(ctx, m.y, len(m.scale))
        if not isinstance(consumers, Skip):
            return AffineFold(label, m.x, affine, consumers)
        made = trace_producer(ctx, m.x, len(m.scale))
        if isinstance(made, Skip):
            return Skip(f"{consumers.why}, nor into the matrix before it: {made.why}")
        return OutputFold(label, m.y, m.x, affine, made)

    def rewrite(self, ctx: PassContext, match: AffineFold | OutputFold) -> None:
        if isinstance(match, OutputFold):
            fold_into_producer(ctx, match)
        else:
            fold_affine(ctx, match.x, match.consumers, match.affine)
