"""fold_constants: evaluate every subgraph that depends only on constants.

Run first, so that a scale computed from initializers (c * gamma_tilde, a
Transpose of a weight, a Cast of a scale) becomes one constant the folding
passes can read. onnx-graphsurgeon's fold_constants evaluates with ONNX Runtime.
"""
from __future__ import annotations

from graph_passes.base import GraphPass, PassContext, Rewrite


class FoldConstants(GraphPass):
    name = "fold_constants"
    summary = "constant-fold subgraphs computed only from initializers (onnx-graphsurgeon)"

    # Pattern:   Constant ──▶ op ──▶ ... (no graph input upstream)   ==>   Constant

    def find(self, ctx: PassContext) -> list[Rewrite]:
        graph = ctx.graph
        before = len(graph.nodes)
        probe = graph.copy()
        probe.fold_constants(error_ok=True).cleanup()
        folded = before - len(probe.nodes)
        if folded <= 0:
            return []

        def apply():
            graph.fold_constants(error_ok=True)
        return [Rewrite("graph", f"{folded} node(s) folded into constants", apply)]
