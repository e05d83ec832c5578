"""What the TensorRT ONNX parser accepts: its operator table, versioned, and the rules the lint checks.

Data and rule functions only; the pass that reports them is graph_passes/trt_lint.py.

Source of the table: onnx-tensorrt docs/operators.md for TensorRT 10.15 ("supports
operators in the inclusive range of opset 9 to opset 24"), operators marked Y and N,
plus the parser changes the TensorRT 11.x release notes list:

    11.0  Swish; custom ops TRT_Attention, TRT_MoE, TRT_KVCacheUpdate (domain trt)
    11.2  DFT (through a cuFFT plugin), 5-D GridSample
    11.5  opset 25, Squeeze without axes

The lint targets TARGET_TRT, the lowest version the `tensorrt` extra allows
(pyproject: tensorrt>=11,<12), so a graph it passes parses on every 11.x.
Restrictions from the table's last column that a graph of ours can break are rules
below (`node_issues`); the rest of that column (Resize modes, pooling dims, ...)
is not checked.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from graph_passes.lazy import stored_lazy

Version = tuple[int, int]

TABLE_VERSION: Version = (10, 15)
TARGET_TRT: Version = (11, 0)

# Marked Y in the 10.15 table, default ONNX domain.
SUPPORTED_10_15 = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool BatchNormalization
BlackmanWindow Cast CastLike Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh
CumSum DeformConv DepthToSpace DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike
Flatten Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool
Greater GreaterOrEqual GridSample GroupNormalization GRU HammingWindow HannWindow HardSigmoid HardSwish
Hardmax Identity If ImageScaler InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less
LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool Mean
MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad
ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean
ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RMSNormalization RNN
RoiAlign RotaryEmbedding Round STFT ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink
Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan
Tanh TensorScatter ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())

# Marked N in the same table: the parser rejects them (named apart so the lint can say so).
UNSUPPORTED_10_15 = frozenset("""
AffineGrid Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor CenterCropPad Col2Im Compress
ConcatFromSequence ConvInteger DFT Det DynamicQuantizeLinear ImageDecoder MatMulInteger MaxRoiPool
MaxUnpool MelWeightMatrix Multinomial NegativeLogLikelihoodLoss Optional OptionalGetElement
OptionalHasElement QLinearConv QLinearMatMul RegexFullMatch SequenceAt SequenceConstruct SequenceEmpty
SequenceErase SequenceInsert SequenceLength SequenceMap SoftmaxCrossEntropyLoss SplitToSequence
StringConcat StringNormalizer StringSplit TfIdfVectorizer Unique
""".split())

# Operators the parser gained after the table (release notes), by the version that added them.
ADDED: dict[Version, frozenset[str]] = {(11, 0): frozenset({"Swish"}), (11, 2): frozenset({"DFT"})}
# Highest default-domain opset the parser reads, from the version that raised it.
MAX_OPSET: dict[Version, int] = {(10, 15): 24, (11, 5): 25}
MIN_OPSET = 9
SQUEEZE_WITHOUT_AXES: Version = (11, 5)

DEFAULT_DOMAINS = ("", "ai.onnx")
TRT_DOMAIN = "trt"          # the parser's own custom ops (TRT_KVCacheUpdate, ...) and plugins
# ONNX element types TensorRT has no type for (the table's data-type list; DOUBLE is cast
# down only where it is a weight, so a float64 tensor is flagged)
UNSUPPORTED_DTYPES = {
    onnx.TensorProto.DOUBLE: "float64", onnx.TensorProto.STRING: "string",
    onnx.TensorProto.COMPLEX64: "complex64", onnx.TensorProto.COMPLEX128: "complex128",
    onnx.TensorProto.UINT16: "uint16", onnx.TensorProto.UINT32: "uint32", onnx.TensorProto.UINT64: "uint64",
}
# TensorScatter: the table's types; its lowering, IKVCacheUpdateLayer, has one mode (kLINEAR)
TENSOR_SCATTER_DTYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                         onnx.TensorProto.INT32}
REDUCE_OPS = frozenset(op for op in SUPPORTED_10_15 if op.startswith("Reduce"))


def version_str(v: Version) -> str:
    return f"{v[0]}.{v[1]}"


def supported_ops(version: Version = TARGET_TRT) -> frozenset[str]:
    """Default-domain operators the parser of `version` accepts (from 10.15 on)."""
    ops = set(SUPPORTED_10_15)
    for since, added in ADDED.items():
        if version >= since:
            ops |= added
    return frozenset(ops)


def max_opset(version: Version = TARGET_TRT) -> int:
    return max(opset for since, opset in MAX_OPSET.items() if version >= since)


def op_support_issue(op: str, version: Version = TARGET_TRT) -> str | None:
    """Why the parser of `version` rejects a default-domain op, or None if it takes it."""
    if op in supported_ops(version):
        return None
    later = sorted(since for since, added in ADDED.items() if op in added)
    if later:
        return f"op supported from TensorRT {version_str(later[0])} on (this lint targets {version_str(version)})"
    if op in UNSUPPORTED_10_15:
        return f"op marked unsupported in the TensorRT {version_str(TABLE_VERSION)} operator table"
    return f"op not in the TensorRT {version_str(TABLE_VERSION)} operator table"


# --- reading a node ----------------------------------------------------------------------------

def _rank(t) -> int | None:
    shape = getattr(t, "shape", None)
    return None if shape is None else len(shape)


def _elem_type(t) -> int | None:
    """ONNX element type of a graphsurgeon tensor, or None where it is unknown."""
    dtype = getattr(t, "dtype", None)       # a Constant's without loading its values
    if dtype is None:
        return None
    if isinstance(dtype, int):
        return dtype
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except (TypeError, KeyError, ValueError):
        return None


def _constant(t) -> np.ndarray | None:
    """The value of an initializer or a Constant node's output, else None (also for a weight computed when
    written, graph_passes/lazy.py: the lint reads shapes and small constants, never weights)."""
    if isinstance(t, gs.Constant):
        return None if stored_lazy(t) is not None else np.asarray(t.values)
    if isinstance(t, gs.Variable) and len(t.inputs) == 1 and t.inputs[0].op == "Constant":
        value = t.inputs[0].attrs.get("value")
        if isinstance(value, gs.Constant):
            return np.asarray(value.values)
    return None


def _present(tensors, indices) -> list:
    """The tensors at `indices` that a node actually uses (optional slots are '' or missing)."""
    return [tensors[i] for i in indices if i < len(tensors) and tensors[i] is not None and tensors[i].name]


def _attr_str(node: gs.Node, name: str, default: str) -> str:
    value = node.attrs.get(name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


# --- per-op rules (the table's Restrictions column) -------------------------------------------------

def _tensor_scatter(node: gs.Node, version: Version) -> list[str]:
    """`past_cache` and `update` must be 4D; `axis` must be -2 (the table); mode linear (KVCacheMode)."""
    issues = []
    for name, t in zip(("past_cache", "update"), node.inputs[:2]):
        rank = _rank(t)
        if rank is not None and rank != 4:
            issues.append(f"TensorScatter {name} {t.name} has rank {rank}; TensorRT needs 4-D [B, H, S, D]")
    axis = node.attrs.get("axis", -2)
    if axis != -2:
        issues.append(f"TensorScatter axis is {axis}; TensorRT needs axis=-2 (the sequence axis of [B, H, S, D])")
    mode = _attr_str(node, "mode", "linear")
    if mode != "linear":
        issues.append(f"TensorScatter mode is '{mode}'; TensorRT's KV-cache update has the linear mode only")
    dtype = _elem_type(node.inputs[0]) if node.inputs else None
    if dtype is not None and dtype not in TENSOR_SCATTER_DTYPES:
        issues.append(f"TensorScatter cache of type {onnx.helper.tensor_dtype_to_string(dtype)}; "
                      "TensorRT takes float, float16, bfloat16, int32")
    return issues


def _attention(node: gs.Node, version: Version) -> list[str]:
    """Q, K, V 4-D; no past_key/past_value/nonpad_kv_seqlen inputs, no present/qk_matmul_output
    outputs, no softcap / qk_matmul_output_mode."""
    issues = []
    if _present(node.inputs, (4, 5)) or _present(node.outputs, (1, 2)):
        issues.append("Attention with past/present KV inputs/outputs; write the cache with TensorScatter")
    if _present(node.inputs, (6,)):
        issues.append("Attention with a nonpad_kv_seqlen input, which TensorRT does not take")
    if _present(node.outputs, (3,)):
        issues.append("Attention with a qk_matmul_output output, which TensorRT does not produce")
    for attr in ("softcap", "qk_matmul_output_mode"):
        if node.attrs.get(attr):
            issues.append(f"Attention attribute {attr}={node.attrs[attr]}, which TensorRT does not support")
    for name, t in zip("QKV", node.inputs[:3]):
        rank = _rank(t)
        if rank is not None and rank != 4:
            issues.append(f"Attention {name} {t.name} has rank {rank}; TensorRT needs 4-D")
    return issues


def _layer_norm(node: gs.Node, version: Version) -> list[str]:
    if _present(node.outputs, (1, 2)):
        return ["LayerNormalization uses its Mean / InvStdDev outputs; TensorRT produces only Y"]
    return []


def _top_k(node: gs.Node, version: Version) -> list[str]:
    return [] if node.attrs.get("sorted", 1) == 1 else ["TopK with sorted=0; TensorRT needs sorted=1"]


def _scatter_nd(node: gs.Node, version: Version) -> list[str]:
    reduction = _attr_str(node, "reduction", "none")
    return [] if reduction == "none" else [f"ScatterND reduction '{reduction}'; TensorRT supports 'none' only"]


def _dropout(node: gs.Node, version: Version) -> list[str]:
    training = _present(node.inputs, (2,))
    if not training:
        return []
    value = _constant(training[0])
    if value is None or bool(np.asarray(value).reshape(-1)[0]):
        return ["Dropout's training_mode must be a constant False for TensorRT"]
    return []


def _reduce(node: gs.Node, version: Version) -> list[str]:
    axes = _present(node.inputs, (1,))
    if axes and _constant(axes[0]) is None:
        return [f"{node.op} axes input {axes[0].name} is computed; TensorRT needs it to be an initializer"]
    return []


def _squeeze(node: gs.Node, version: Version) -> list[str]:
    if "axes" in node.attrs or _present(node.inputs, (1,)) or version >= SQUEEZE_WITHOUT_AXES:
        return []
    return [f"Squeeze without axes; TensorRT parses that from {version_str(SQUEEZE_WITHOUT_AXES)} on "
            f"(this lint targets {version_str(version)}): give it an axes input (export/emit.py does)"]


RULES = {"TensorScatter": _tensor_scatter, "Attention": _attention, "LayerNormalization": _layer_norm,
         "TopK": _top_k, "ScatterND": _scatter_nd, "Dropout": _dropout, "Squeeze": _squeeze,
         **{op: _reduce for op in REDUCE_OPS}}


# --- whole graph ---------------------------------------------------------------------------------

def _is_graph_output(graph: gs.Graph, t) -> bool:
    return any(o is t for o in graph.outputs)


def node_issues(graph: gs.Graph, node: gs.Node, version: Version = TARGET_TRT) -> list[str]:
    """What the parser of `version` rejects about one node (empty when nothing)."""
    domain = node.domain or ""
    issues = []
    if domain == TRT_DOMAIN:
        return issues
    if domain not in DEFAULT_DOMAINS:
        return [f"custom domain '{domain}' is unknown to the TensorRT parser"]
    why = op_support_issue(node.op, version)
    if why:
        issues.append(why)
    rule = RULES.get(node.op)
    if rule is not None:
        issues += rule(node, version)
    if node.op == "If" and any(_is_graph_output(graph, o) for o in node.outputs):
        issues.append("If node produces a graph output (merged decoder); export one graph for prefill and decode")
    to = node.attrs.get("to") if node.op in ("Cast", "ConstantOfShape", "RandomNormal", "RandomUniform") else None
    if isinstance(to, int) and to in UNSUPPORTED_DTYPES:
        issues.append(f"casts to {UNSUPPORTED_DTYPES[to]}, which has no TensorRT type")
    return issues


def graph_issues(graph: gs.Graph, version: Version = TARGET_TRT) -> list[str]:
    """One line per opset, node or tensor the parser of `version` would reject."""
    issues = []
    opset = getattr(graph, "opset", None)
    top = max_opset(version)
    if isinstance(opset, int) and not MIN_OPSET <= opset <= top:
        issues.append(f"opset {opset}: the TensorRT {version_str(version)} parser reads opsets {MIN_OPSET}..{top}")
    for node in graph.nodes:
        where = f"{node.name or node.op} ({node.op})"
        issues += [f"{where}: {issue}" for issue in node_issues(graph, node, version)]
    seen = set()
    for t in graph.tensors().values():
        dtype = _elem_type(t)
        if dtype in UNSUPPORTED_DTYPES and t.name not in seen:
            seen.add(t.name)
            issues.append(f"{t.name}: dtype {UNSUPPORTED_DTYPES[dtype]} has no TensorRT type")
    return issues
