"""trt_lint: list what the TensorRT 11 ONNX parser cannot take. Rewrites nothing.

Checked (shared/design/METHOD.md section 4):
- If nodes whose outputs are graph outputs (the merged-decoder layout of
  Hugging Face Optimum): the parser rejects them.
- Attention nodes that carry past/present caches (inputs 4-5 or outputs 1-2).
- Ops outside the parser's operator table (onnx-tensorrt docs/operators.md, with
  the version it is taken from; graph_passes/trt_ops.py), and ops from custom
  domains other than TensorRT's own (trt).
- The table's restrictions a decoder graph can break: TensorScatter 4-D on axis -2
  (linear mode), Attention without past/present, the default-domain opset range, ...
- Tensor dtypes TensorRT has no type for (float64, strings, complex, unsigned
  integers other than uint8).

`python -m graph_passes IN -o OUT --strict` exits non-zero when this pass finds
anything; without --strict the findings are printed and recorded only.
"""
from __future__ import annotations

from graph_passes.base import GraphPass, PassContext, Rewrite
from graph_passes.trt_ops import TARGET_TRT, graph_issues


def lint_graph(ctx: PassContext) -> list[str]:
    """One line per opset, node or tensor the TensorRT parser would reject (rules in graph_passes.trt_ops)."""
    return graph_issues(ctx.graph, TARGET_TRT)


class TensorRTLint(GraphPass):
    name = "trt_lint"
    summary = "list nodes and dtypes the TensorRT 11 ONNX parser rejects (no rewrite; --strict fails on any)"

    # Pattern (flagged, never rewritten):
    #
    #     If ──▶ graph output            Attention(q, k, v, mask, past_k, past_v) ──▶ present_k, present_v
    #     <op not in trt_ops' table>     tensor of dtype float64 / string / complex / uint16-64
    #     TensorScatter(cache rank != 4 or axis != -2)

    def find(self, ctx: PassContext) -> list[Rewrite]:
        for issue in lint_graph(ctx):
            ctx.note(f"trt: {issue}")
        return []
