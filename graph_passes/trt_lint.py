"""trt_lint: list what the TensorRT 11 ONNX parser cannot take. Rewrites nothing.

Checked (shared/design/METHOD.md section 4):
- If nodes whose outputs are graph outputs (the merged-decoder layout of
  Hugging Face Optimum): the parser rejects them.
- Attention nodes that carry past/present caches (inputs 4-5 or outputs 1-2).
- Ops outside the parser's operator list, and ops from custom domains other
  than TensorRT's own (trt).
- Tensor dtypes TensorRT has no type for (float64, strings, complex, unsigned
  integers other than uint8).

`python -m graph_passes IN -o OUT --strict` exits non-zero when this pass finds
anything; without --strict the findings are printed and recorded only.
"""
from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

from graph_passes.base import Finding, GraphPass, PassContext, PassResult

# Operators of the TensorRT 10.x/11 ONNX parser (onnx-tensorrt docs/operators.md), default domain.
TRT_ONNX_OPS = frozenset("""
Abs Acos Acosh Add AffineGrid And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool
BatchNormalization BitwiseAnd BitwiseNot BitwiseOr BitwiseXor BlackmanWindow Cast CastLike Ceil Celu Clip
Compress Concat ConcatFromSequence Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum
DFT DeformConv DepthToSpace DequantizeLinear Div Dropout DynamicQuantizeLinear Einsum Elu Equal Erf Exp
Expand EyeLike Flatten Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool
GlobalMaxPool Greater GreaterOrEqual GridSample GroupNormalization GRU HammingWindow HannWindow
HardSigmoid HardSwish Hardmax Identity If ImageScaler InstanceNormalization IsInf IsNaN LayerNormalization
LeakyRelu Less LessOrEqual Log LogSoftmax Loop LpNormalization LpPool LRN LSTM MatMul MatMulInteger
Max MaxPool MaxRoi MaxUnpool Mean MeanVarianceNormalization Min Mish Mod Mul Multinomial Neg
NonMaxSuppression NonZero Not OneHot Or Pad ParametricSoftplus Pow PRelu QLinearConv QLinearMatMul
QuantizeLinear RandomNormal RandomNormalLike RandomUniform RandomUniformLike Range Reciprocal ReduceL1
ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum
ReduceSumSquare Relu Reshape Resize ReverseSequence RMSNormalization RNN RoiAlign RotaryEmbedding Round
ScaledTanh Scan Scatter ScatterElements ScatterND Selu SequenceAt SequenceConstruct SequenceEmpty
SequenceErase SequenceInsert SequenceLength Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax
Softplus Softsign SpaceToDepth Split SplitToSequence Sqrt Squeeze STFT Sub Sum Tan Tanh TensorScatter
ThresholdedRelu Tile TopK Transpose Trilu Unique Unsqueeze Upsample Where Xor
""".split())
TRT_DOMAINS = ("", "ai.onnx", "trt")
UNSUPPORTED_DTYPES = {
    onnx.TensorProto.DOUBLE: "float64", onnx.TensorProto.STRING: "string",
    onnx.TensorProto.COMPLEX64: "complex64", onnx.TensorProto.COMPLEX128: "complex128",
    onnx.TensorProto.UINT16: "uint16", onnx.TensorProto.UINT32: "uint32", onnx.TensorProto.UINT64: "uint64",
}


def lint_graph(ctx: PassContext) -> list[str]:
    """One line per node or tensor the parser would reject."""
    issues = []
    graph = ctx.graph
    for node in graph.nodes:
        where = f"{node.name or node.op} ({node.op})"
        domain = node.domain or ""
        if domain not in TRT_DOMAINS:
            issues.append(f"{where}: custom domain '{domain}' is unknown to the TensorRT parser")
        elif domain != "trt" and node.op not in TRT_ONNX_OPS:
            issues.append(f"{where}: op not supported by the TensorRT 11 ONNX parser")
        if node.op == "If" and any(ctx.is_graph_output(o) for o in node.outputs):
            issues.append(f"{where}: If node produces a graph output (merged decoder); export one graph for prefill and decode")
        if node.op == "Attention":
            past = [t for t in node.inputs[4:6] if t is not None and t.name]
            present = [t for t in node.outputs[1:3] if t is not None and t.name]
            if past or present:
                issues.append(f"{where}: Attention with past/present KV inputs/outputs; write the cache with TensorScatter")
        to = node.attrs.get("to") if node.op in ("Cast", "ConstantOfShape", "RandomNormal", "RandomUniform") else None
        if isinstance(to, int) and to in UNSUPPORTED_DTYPES:
            issues.append(f"{where}: casts to {UNSUPPORTED_DTYPES[to]}, which has no TensorRT type")
    seen = set()
    for t in graph.tensors().values():
        dtype = _onnx_dtype(t)
        if dtype in UNSUPPORTED_DTYPES and t.name not in seen:
            seen.add(t.name)
            issues.append(f"{t.name}: dtype {UNSUPPORTED_DTYPES[dtype]} has no TensorRT type")
    return issues


def _onnx_dtype(t: gs.Tensor):
    dtype = t.dtype if isinstance(t, gs.Variable) else getattr(t.values, "dtype", None)
    if dtype is None:
        return None
    if isinstance(dtype, int):
        return dtype
    try:
        import numpy as np
        return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except (TypeError, KeyError, ValueError):
        return None


class TensorRTLint(GraphPass):
    name = "trt_lint"
    summary = "list nodes and dtypes the TensorRT 11 ONNX parser rejects (no rewrite; --strict fails on any)"

    # Pattern (flagged, never rewritten):
    #
    #     If ──▶ graph output            Attention(q, k, v, mask, past_k, past_v) ──▶ present_k, present_v
    #     <op not in TRT_ONNX_OPS>       tensor of dtype float64 / string / complex / uint16-64

    def run(self, ctx: PassContext) -> PassResult:
        """Not a matching pass: one typed lint finding per issue, nothing rewritten."""
        where_why = (issue.split(": ", 1) for issue in lint_graph(ctx))
        return PassResult(self.name, findings=[Finding(self.name, where, why, kind="lint") for where, why in where_why])
