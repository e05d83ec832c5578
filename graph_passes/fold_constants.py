"""fold_constants: evaluate every subgraph that depends only on constants, once.

Run first, so that a scale computed from initializers (c * gamma_tilde, a
Transpose of a weight, a Cast of a scale) becomes one constant the folding
passes can read. onnx-graphsurgeon's fold_constants evaluates with ONNX Runtime,
If / Loop bodies included. Not a matching pass: it overrides `run`.
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from graph_passes.base import Folded, GraphPass, PassContext, PassResult


class FoldConstants(GraphPass):
    name = "fold_constants"
    summary = "constant-fold subgraphs computed only from initializers (onnx-graphsurgeon), once"

    # Pattern:   Constant ──▶ op ──▶ ... (no graph input upstream)   ==>   Constant

    def run(self, ctx: PassContext) -> PassResult:
        before = sum(len(g.nodes) for g in ctx.graphs())
        logger = gs.logger.G_LOGGER
        severity, logger.severity = logger.severity, logger.ERROR
        try:        # its warning that a folded constant is large (a transposed weight) is not ours to print
            ctx.root.fold_constants(error_ok=True, recurse_subgraphs=True)
        finally:
            logger.severity = severity
        ctx.cleanup()
        folded = before - sum(len(g.nodes) for g in ctx.graphs())
        result = PassResult(self.name)
        if folded > 0:
            result.folded.append(Folded("graph", f"{folded} node(s) folded into constants"))
        return result
