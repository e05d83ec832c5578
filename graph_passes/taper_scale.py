"""taper_scale: fold a g = 0 TaperNorm (a per-channel scale, and a shift for the affine variant).

At g = 0 a TaperNorm is h -> h * (c * gamma_tilde) [+ beta_tilde] (models/norms.py),
exported as one Mul by a constant vector (and one Add). It folds into every
linear layer it feeds: Q, K, V (or fused QKV), MLP up (and gate), and, with
All-Taper, the LM head (cloned first when it is tied to the embedding).

Which Muls are TaperNorms: nodes whose torch provenance (node metadata
pkg.torch.onnx.class_hierarchy) names models.norms.TaperNorm; in a graph from
another exporter (no provenance), any Mul by a constant per-channel vector whose
input does not come from a Tanh (that one is DyT's: see dyt_affine). The gate
comes from the model metadata tapernorm.gate: a TaperNorm graph whose gate is
not 0 still has its normalized branch, and the pass refuses it with one line.
"""
from __future__ import annotations

from graph_passes.base import GraphPass, PassContext, PassError, Rewrite, producer
from graph_passes.linear_fold import fold_later, match_linear_consumers, match_scale_shift

TAPER_CLASS = "TaperNorm"


def taper_layers(ctx: PassContext) -> dict[str, list[str]]:
    """Layer name -> op types of the nodes the exporter attributed to a TaperNorm."""
    layers: dict[str, list[str]] = {}
    for node in ctx.graph.nodes:
        if any(c.rsplit(".", 1)[-1] == TAPER_CLASS for c in ctx.module_class(node)):
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

    # Pattern (exact; anything else is left alone with a note):
    #
    #     h ──▶ Mul(h, s) ──▶ [Add(·, beta)] ──┬──▶ MatMul(W_q) [▶ Add(b_q)]
    #           s: constant [d]   beta: [d]     ├──▶ MatMul(W_k) [▶ Add(b_k)]
    #                                           └──▶ ... every consumer a MatMul/Gemm, constant W [d, out]
    #   ==>
    #     h ──▶ MatMul(diag(s) W) ▶ Add(b + beta W)     (new constants; Mul and Add removed)

    def _selects(self, ctx: PassContext, node) -> bool:
        if node.op != "Mul":
            return False
        if ctx.has_provenance(node):
            return any(c.rsplit(".", 1)[-1] == TAPER_CLASS for c in ctx.module_class(node))
        src = [producer(t) for t in node.inputs]
        return not any(p is not None and p.op == "Tanh" for p in src)

    def find(self, ctx: PassContext) -> list[Rewrite]:
        info = detect_taper(ctx)
        if info["layers"] and not info["foldable"]:
            names = ", ".join(sorted(info["layers"]))
            gate = info["gate"] if info["gate"] is not None else "above 0 (normalized branch present)"
            raise PassError(f"{names}: TaperNorm gate {gate}; folding needs gate 0 "
                            "(finish the taper, or build without --fuse)")
        rewrites = []
        tagged = bool(info["layers"])
        for node in list(ctx.graph.nodes):
            if not self._selects(ctx, node):
                continue
            label = ctx.layer_name(node)
            m, why = match_scale_shift(ctx, node)
            if m is None:
                if tagged or "broadcast" in why:     # a per-channel-looking scale that is not one: say so
                    ctx.note(f"{label}: left unfolded: {why}")
                continue
            if ctx.has_provenance(node) and len(m["nodes"]) == 2 and \
                    ctx.layer_name(m["nodes"][1]) != label:
                m["shift"], m["y"], m["nodes"] = None, node.outputs[0], m["nodes"][:1]
            uses, why = match_linear_consumers(ctx, m["y"], len(m["scale"]))
            if not uses:
                if tagged or ctx.has_provenance(node):
                    ctx.note(f"{label}: left unfolded: {why}")
                continue
            if m["shift"] is not None and len(m["shift"]) not in (1, uses[0].weight.shape[0]):
                ctx.note(f"{label}: left unfolded: shift width {len(m['shift'])} does not match")
                continue
            detail = ("scale+shift" if m["shift"] is not None else "scale") + " -> " + \
                ", ".join(u.label for u in uses)
            rewrites.append(Rewrite(label, detail, fold_later(ctx, m, uses)))
        return rewrites

