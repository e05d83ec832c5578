"""Merge a linear layer's bias Add and the residual Add after it into one Sum (ONNX Runtime builds).

A GPT-2-style block adds twice after each of its output projections (attention out, MLP down):

    x + (h W + b)          MatMul, Add(bias), Add(residual): three kernel launches

ONNX Runtime's CPU provider fuses MatMul + Add into Gemm only for 2-D inputs, and a decoder's
activations are [B, S, d], so the bias stays a node of its own. One variadic Sum(x, h W, b)
does both additions in one kernel. At batch 1 a tiny model is launch-bound (~0.9 us a node on
this project's machine): on the 1M zoo model (4 layers) the fp32 decode step drops from 61 to
53 nodes, ~7 us by that count; timed end to end, the change is within this machine's noise
(docs/bench.md, "Re-run on the current code"). Sum adds left to right, (x + h W) + b instead of x + (h W + b):
one fp32 rounding apart, within the build's fp32 tolerance (the build verifies it).

Quantized builds put the bias back into MatMulNBits (graph_passes/quantized.py, mnb_bias: its
bias input is the kernel's own epilogue, as ONNX Runtime's MatMulNBits + Add fusion would do
it), so there the residual is one Add again. Run on request (`--attention gqa`, the ONNX Runtime graph), after
the folds: a fold rewrites a bias (b + beta W), and this pass would hide it from them.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from graph_passes.base import GraphPass, Match, PassContext, Skip, const_value, is_float, producer


@dataclass
class BiasSumMatch(Match):
    residual_add: gs.Node
    residual: gs.Tensor           # x
    matmul_out: gs.Tensor         # h W
    bias: gs.Tensor               # b, a constant [N]

    @property
    def detail(self) -> str:
        return "bias Add + residual Add -> one Sum"


class OrtBiasSum(GraphPass):
    name = "ort_bias_sum"
    summary = "x + (MatMul + bias) -> Sum(x, MatMul, bias): one kernel instead of two (ONNX Runtime builds)"
    anchors = ("Add",)

    # Pattern (one fp32 rounding apart: Sum adds left to right):
    #
    #     h ──▶ MatMul(W) ──▶ Add(b) ──▶ Add ──▶ y          b: a constant vector [N]
    #     x ─────────────────────────────┘                  (the MatMul and bias Add outputs used only here)
    #   ==>
    #     Sum(x, MatMul(h, W), b) ──▶ y
    #
    # Left alone: an inner Add that is not MatMul + constant bias, or whose result is used elsewhere.

    def match(self, ctx: PassContext, node: gs.Node) -> BiasSumMatch | Skip | None:
        for residual, inner in ((node.inputs[0], producer(node.inputs[1])),
                                (node.inputs[1], producer(node.inputs[0]))):
            if inner is None or inner.op != "Add" or not _used_only_by(ctx, inner.outputs[0], node):
                continue
            for mm_out, bias in ((inner.inputs[0], inner.inputs[1]), (inner.inputs[1], inner.inputs[0])):
                mm = producer(mm_out)
                value = const_value(bias)
                if mm is None or mm.op != "MatMul" or not _used_only_by(ctx, mm_out, inner):
                    continue
                if value is None or value.ndim != 1 or not is_float(value.dtype):
                    return Skip(f"{inner.name}: the Add after {mm.name} is not a constant bias vector")
                return BiasSumMatch(ctx.layer_name(mm), node, residual, mm_out, bias)
        return None

    def rewrite(self, ctx: PassContext, m: BiasSumMatch) -> None:
        y = m.residual_add.outputs[0]
        m.residual_add.outputs.clear()           # the old pair lets go of y; cleanup drops both Adds
        ctx.graph.nodes.append(gs.Node("Sum", ctx.fresh_name("residual_bias_Sum"),
                                       inputs=[m.residual, m.matmul_out, m.bias], outputs=[y]))


def _used_only_by(ctx: PassContext, t: gs.Tensor, node: gs.Node) -> bool:
    return len(t.outputs) == 1 and t.outputs[0] is node and not ctx.is_graph_output(t)
