"""The pass registry (name -> class), the default order, and `run_passes`.

Adding a pass is one file (a GraphPass subclass) plus one line in PASS_CLASSES.
tests/graph_passes/test_registry.py fails when a registered pass has no test file.
"""
from __future__ import annotations

import onnx

from graph_passes.base import GraphPass, PassContext, PassResult, load_graph, save_graph
from graph_passes.channel_scale import FoldChannelScale
from graph_passes.disabled_norm import FoldDisabledNorm
from graph_passes.dyt_affine import FoldDyTAffine
from graph_passes.fold_constants import FoldConstants
from graph_passes.norm_gamma import FoldNormGamma
from graph_passes.ort_attention import OrtGroupQueryAttention
from graph_passes.ort_bias_sum import OrtBiasSum
from graph_passes.taper_scale import FoldTaperScale
from graph_passes.trt_lint import TensorRTLint

# in the default order: constants first (scales computed from initializers become
# constants), the TaperNorm (refuses a gate above 0), disabled norms before
# norm_gamma (so the op goes away whole), the lint last
PASS_CLASSES = (FoldConstants, FoldTaperScale, FoldChannelScale, FoldDisabledNorm, FoldNormGamma, FoldDyTAffine,
                OrtGroupQueryAttention, OrtBiasSum, TensorRTLint)
PASSES: dict[str, type[GraphPass]] = {cls.name: cls for cls in PASS_CLASSES}
# the target-specific rewrites (ONNX Runtime only) run on request, not by default
ORT_PASSES = ("ort_gqa", "ort_bias_sum")
DEFAULT_PASSES = tuple(n for n in PASSES if n not in ORT_PASSES)


def passes_for(attention: str) -> tuple[str, ...]:
    """The fold passes of a build; with attention "gqa" the ONNX Runtime rewrites too, after the
    folds (they read shapes that onnx's inference cannot carry through a com.microsoft op, and
    rewrite biases that a Sum would hide) and before the TensorRT lint (which then says the
    graph is ONNX Runtime only)."""
    if attention != "gqa":
        return DEFAULT_PASSES
    return (*DEFAULT_PASSES[:-1], *ORT_PASSES, DEFAULT_PASSES[-1])
# which registered passes each norm kind of models/ exercises (coverage test reads this)
NORM_KIND_PASSES = {"taper": "taper_scale", "rmsnorm": "norm_gamma", "layernorm": "norm_gamma", "dyt": "dyt_affine"}


def resolve(passes) -> list[GraphPass]:
    """GraphPass objects of `passes`: registered names, or passes made already (e.g. export.quantize's, which
    take the quantizer)."""
    unknown = [n for n in passes if isinstance(n, str) and n not in PASSES]
    if unknown:
        raise KeyError(f"unknown pass {', '.join(unknown)}; known passes: {', '.join(PASSES)}")
    return [PASSES[n]() if isinstance(n, str) else n for n in passes]


def run_passes(proto: onnx.ModelProto, names=DEFAULT_PASSES,
               lazy: dict | None = None) -> tuple[onnx.ModelProto, list[PassResult]]:
    """Apply the named passes in order; returns the rewritten model and one result per pass.
    `lazy`: the graph's weights computed when written (graph_passes/lazy.py), by initializer name;
    replaced in place by those of the rewritten graph.

    Raises graph_passes.PassError for a graph a pass refuses (e.g. a TaperNorm gate above 0).
    """
    ctx = load_graph(proto, lazy)
    results = run_passes_in(ctx, names)
    if lazy is not None:
        lazy.clear()
        lazy.update(ctx.lazy_weights())
    return save_graph(ctx, proto), results


def run_passes_in(ctx: PassContext, passes) -> list[PassResult]:
    """Apply `passes` (registered names or GraphPass objects) in order to a loaded graph, one result per
    pass: what a caller that runs several stages of passes on one graph (export's build: the folds, then
    the quantization) calls between one load_graph and one save_graph."""
    return [p.run(ctx) for p in resolve(passes)]
