"""A build's graph, before it is written: emitted from the model's spec, then folded and quantized on ONE
loaded graph (a graph_passes PassContext: the graphsurgeon import runs once a build; shape inference runs
again only between the folds and the quantization, PassContext.next_stage, so that the written graph is the
one a load per stage wrote).

    emit (export/emit.py) ─▶ load_graph ─▶ the fold passes ─▶ the leftover TaperNorm check
                                        ─▶ the quantize passes (export/quantize.py) ─▶ save_graph
                          ─▶ [bf16 weights] ─▶ [fp16 KV cache] ─▶ [logits_from] ─▶ op counts, norm layers

Nothing is read but the norms' vectors: every matrix is a Lazy, and the folds and the quantization
record their arithmetic on it, run when the graph is written (export.pipeline.write_graph). The
statistics read the protos (op counts, each norm op's layer from its node metadata), not a loaded graph.
"""
from __future__ import annotations

from graph_passes.base import layer_name_of, op_counts
from export.options import BuildError, graph_kind
from export.report import NORM_OPS, BuildReport, Fold, QuantizedPart


def make_graph(source, report: BuildReport, fuse: bool, dtype: str, attention: str, quantize=None,
               fold: bool = True, rmsnorm: str = "op", kv_cache: str = "fp32"):
    """The graph of `source` (a models.weights.WeightSource) and its Lazy weights: emitted, folded (fuse; with
    attention "gqa" also ONNX Runtime's rewrites; fold=False: those alone), quantized. Nothing is read
    but the norms' vectors; the folds and the quantization run on each weight when it is written."""
    from export.emit import emit_graph
    emitted = emit_graph(source, dtype, "fused" if attention == "gqa" else attention, rmsnorm,
                         live_cut=False if attention == "gqa" else None)
    proto, lazy = emitted.proto, emitted.lazy
    graph_stats(report, "emitted", proto)
    if fuse or attention == "gqa" or quantize is not None:
        proto, lazy = _rewritten(proto, lazy, report, fuse or attention == "gqa", attention, quantize, fold)
    if dtype == "bf16":                 # the weights, folded in fp32, rounded to bf16 once
        from export.bfloat16 import bf16_graph
        proto = bf16_graph(proto, lazy, emitted.fp32)
    if kv_cache == "fp16":              # (check_kv_cache: a GroupQueryAttention graph; int8 is made once the
                                        # weights are written: its scales are calibrated on them, export/kv_int8.py)
        from graph_passes.ort_attention import with_cache_dtype
        proto = with_cache_dtype(proto, kv_cache)
    if attention == "gqa":              # the ONNX Runtime graph the scheduler serves: a prefill's logits at its
        from graph_passes.logits_from import with_logits_from       # last token only (the input's default: all)
        proto = with_logits_from(proto)
    graph_stats(report, graph_kind(fuse, quantize), proto)
    return proto, lazy


def _rewritten(proto, lazy: dict, report: BuildReport, passes: bool, attention: str, quantize, fold: bool):
    """The emitted graph loaded once: the fold passes (`passes`), then the quantize passes, then saved; the
    graph and its Lazy weights."""
    from graph_passes.base import load_graph, save_graph
    ctx = load_graph(proto, lazy)
    if passes:
        fuse_stage(ctx, report, attention, fold)
    summary = None
    if quantize is not None:
        from export.quantize import quantize_passes
        if passes:
            ctx.next_stage(proto)       # the shapes and names the folded graph had when quantized from its own load
        summary = quantize_passes(ctx, quantize)
    out = save_graph(ctx, proto)
    if summary is not None:
        from export.quantize import quantized_graph
        out = quantized_graph(out, quantize, summary)
        report.quantized = QuantizedPart(quantize.file_name(), summary)
    return out, ctx.lazy_weights()


def fuse_stage(ctx, report: BuildReport, attention: str = "plain", fold: bool = True) -> None:
    """Run the default passes (and with attention "gqa" the ONNX Runtime rewrite) on the loaded graph `ctx`;
    every TaperNorm must fold and every layer's attention must become GroupQueryAttention (a leftover is an
    error, with the reasons). fold=False: the ONNX Runtime rewrites alone, norms left as emitted
    (with attention "gqa": an unfolded graph on the same attention kernel, bench's unfused variants)."""
    from graph_passes import passes_for, run_passes_in
    from graph_passes.registry import ORT_PASSES
    results = run_passes_in(ctx, passes_for(attention) if fold else ORT_PASSES)
    for r in results:
        if r.name == "fold_constants":
            report.notes += [f"fold_constants: {d}" for _, d in r.rewrites]
            continue
        if r.name == "ort_gqa" and r.skipped:
            raise BuildError(f"--attention gqa: {len(r.skipped)} layer(s) left as ONNX Attention ({r.skipped[0]}); "
                             "build with --attention fused or plain")
        report.folded += [Fold(r.name, f.where, f.detail) for f in r.folded]
        report.notes += [str(f) for f in r.skipped]
        report.trt_lint += [str(f) for f in r.lint]
    leftover = leftover_taper(ctx) if fold else []
    if leftover:
        why = "; ".join(report.notes) or "no matching pattern"
        raise BuildError(f"{', '.join(leftover)}: TaperNorm left unfolded ({why})")


def leftover_taper(ctx) -> list[str]:
    """TaperNorm nodes still in a folded graph (by their provenance)."""
    return sorted({ctx.layer_name(n) for n in ctx.graph.nodes
                   if any(c.endswith(".TaperNorm") for c in ctx.module_class(n))})


def graph_stats(report: BuildReport, kind: str, proto) -> None:
    """The graph's op counts and the layers of the normalization ops left in it."""
    report.op_counts[kind] = op_counts(proto)
    report.norm_layers[kind] = norm_layers(proto)


def norm_layers(proto) -> list[str]:
    """The layer (module path, from the node's provenance) of each normalization op of the main graph."""
    return [layer_name_of(n.name, {p.key: p.value for p in n.metadata_props})
            for n in proto.graph.node if n.op_type in NORM_OPS]
