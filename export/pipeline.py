"""The build behind `python -m export.build`: one route for every size, in named stages with a typed report.

    open the weights (headers only) ─▶ memory estimate (export/memory.py: refuse in one line when it cannot fit)
      ─▶ the graph (export/graph_stages.py): emitted from the model's spec, every matrix a Lazy, unread;
         [fold] and [quantize] by graph_passes on one loaded graph, each recorded on the weight it changes
      ─▶ write: each weight read, folded, cast or quantized and written, one at a time (write_graph)
      ─▶ verify (export/reference_check.py): the torch reference, block by block, vs the graph in ONNX Runtime
      ─▶ [a Hugging Face folder: our torch reference (its fp32 run above) vs transformers' (export/transformers_check.py)]
      ─▶ [--genai: GenAI's folder (export/genai.py)] ─▶ config.json, tokenizer.json, report.json

The options are one export.options.BuildOptions, checked when it is made; the report is an
export.report.BuildReport in typed parts, written as report.json. One graph is written: model.onnx (no
--fuse), model.fused.onnx (--fuse) or model.<int8|int4>.onnx (--quantize). The same stages build a 1M
model and an 8B one: the weights flow once, from the memory-mapped checkpoint through the passes'
recorded arithmetic into the graph's external data, and nothing holds the model whole; only one model is
alive at a time (the reference holds one block, then is gone before ONNX Runtime loads the graph).

The whole build writes into a temporary sibling of OUT that core.outputs.output_dir swaps into place at
the end: an interrupted or failed build leaves OUT as it was, and OUT is replaced only when it is an
earlier build (it carries the build marker), never when it is or holds the checkpoint. The checkpoint
may be a Hugging Face folder (models/convert.py maps its tensors as they are read; the build's
config.json is the converted one). `build_graph` runs the graph stages for a caller that keeps its
own files (bench's build cache), on a model in memory (models.weights.model_weights).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from core.build_files import REPORT
from core.inputs import check_memory, human_bytes
from core.outputs import BUILD, MARKER, check_output_dir, output_dir, sign_onnx
from export.graph_stages import make_graph
from export.memory import build_memory, cheaper_option, transformers_check_bytes
from export.options import BuildOptions, check_dtype, check_gate, tolerance_key
from export.reference_check import eps_approximation, real_tokens, verify_graph
from export.report import BuildReport, ModelSummary, Stages, Verification, summary
from export.target import target_of
from export.transformers_check import TransformersImports, transformers_check, transformers_steps


def build(checkpoint: Path, out: Path, options: BuildOptions, log=print, source=None) -> BuildReport:
    """Every stage; returns the report (also written to OUT/report.json). `options`: what to build, checked
    when made (export/options.py). `source`: the checkpoint's weights already opened
    (models.weights.open_weights), e.g. by the CLI's target choice."""
    from export.verify import ATOL, SCALE_TOL
    from models.checkpoint import TOKENIZER
    from models.weights import open_weights
    checkpoint, out, o = Path(checkpoint), Path(out), options
    check_output_dir(out, BUILD, inputs=[checkpoint])
    if o.genai:
        from export.genai import check_tokenizer_files
        check_tokenizer_files(checkpoint)      # the files it would copy for GenAI's tokenizer, before any work
    t_start = time.perf_counter()
    source = source or open_weights(checkpoint)
    cfg = source.cfg
    check_gate(source.skeleton, o.fuse)
    check_dtype(cfg, o.dtype)
    estimate = build_memory(cfg, o.dtype, o.quantize)
    params = cfg.approx_param_count()
    check_memory(estimate.peak, f"{checkpoint}: the build of {params / 1e9:.2f}B parameters",
                 cheaper_option(cfg, o.dtype, o.quantize), share=1.0, needs=estimate.line())
    key = o.tolerance_key
    report = BuildReport(str(checkpoint), str(out), o.dtype, o.fuse, attention=o.attention,
                         verification=Verification(ATOL[key], SCALE_TOL[key]), target=target_of(o.attention),
                         target_why=o.target_why, kv_cache=o.kv_cache, kv_cache_why=o.kv_cache_why)
    gate = source.skeleton.gate.value if cfg.norm == "taper" else None
    report.model = ModelSummary.of(cfg, gate, params)
    report.source, report.notes = source.source, list(source.notes)
    report.memory_estimate = estimate
    name = o.graph_name
    report.graph = name
    stages = Stages(report, 5 + (1 if o.genai else 0) + (1 if o.kv_cache == "int8" else 0), log)
    t0 = stages.start(f"open {checkpoint} ({_source_line(source.source)}): weights read as they are written")
    stages.done("open", t0, f": {cfg.norm}{' (' + cfg.taper_scope + ')' if cfg.taper_scope else ''}, {params:,} "
                f"params, {cfg.n_layer} layers, gate {'-' if gate is None else gate}; estimated peak {estimate.line()}"
                + (f"; then the transformers check, apart: up to ~{human_bytes(transformers_check_bytes(cfg))} "
                   "(skipped where that does not fit)" if source.source.startswith("hf:") else ""))
    for note in source.notes:
        log(f"      note: {note}")
    tokenizer = source.where / TOKENIZER if (source.where / TOKENIZER).is_file() else None
    if tokenizer is None:
        report.notes.append(f"{checkpoint} has no {TOKENIZER}: verified on random tokens only; generation needs one")
    tokens = real_tokens(tokenizer, cfg.vocab_size)
    quantize = o.quantize
    with output_dir(out, BUILD, inputs=[checkpoint]) as tmp:
        from graph_passes import passes_for
        t0 = stages.start(f"graph {name}: emitted from the model's spec ({o.dtype}, {o.attention} attention)"
                          + (f"; fold: {', '.join(passes_for(o.attention))}" if o.fuse else "")
                          + (f"; quantize {quantize.dtype} ({quantize.algo}, block {quantize.block_size})" if quantize else ""))
        proto, lazy = make_graph(source, report, o.fuse, o.dtype, o.attention, quantize, kv_cache=o.kv_cache)
        stages.done("graph", t0, f": {len(proto.graph.node)} nodes, {len(report.folded)} layer(s) folded, "
                    f"{report.norm_ops.get(o.graph_kind, 0)} norm op(s) left")
        t0 = stages.start(f"write {name} (each weight read, {'folded, ' if o.fuse else ''}"
                          f"{'quantized' if quantize else 'cast to ' + o.dtype} and written, block by block)")
        report.weight_bytes = write_graph(proto, lazy, tmp / name, stages.log, cfg.n_layer)
        if report.quantized is not None:
            report.quantized.summary.weight_bytes_after = report.weight_bytes
        del proto, lazy
        stages.done("write", t0, f": {report.weight_bytes / 1e9:.2f} GB of weights")
        imports = TransformersImports(source)
        ours = verify_graph(source, tmp / name, report, stages, o.dtype, quantize, tokens, same_start=o.attention == "gqa",
                            also=transformers_steps(source, tokens), meanwhile=imports.start)
        report.eps_approximation = eps_approximation(source, tmp / name, tokens, o.attention == "gqa")
        transformers_check(source, report, stages.log, tokens, ours, imports)
        if o.kv_cache == "int8":        # on the graph just verified with its fp32 cache (export/kv_int8.py)
            from export.kv_int8 import int8_cache
            t0 = stages.start(f"int8 KV cache: scales calibrated on {name} (fp32 cache), then checked against it"
                              f"{' (' + o.kv_cache_why + ')' if o.kv_cache_why else ''}")
            check = report.kv_cache_check = int8_cache(tmp / name, tokenizer, stages.log,
                                                       keep_fp32=o.kv_cache_falls_back)
            if check.kept_fp32:
                report.kv_cache = "fp32"
                report.kv_cache_why = f"auto: fp32 (the int8 cache tried first drifted {check.drift:.2%} > {check.bound:.0%})"
                report.notes.append(f"--kv-cache auto: {check.line()}")
            stages.done("kv_int8", t0)
        if o.genai:
            report.genai = genai_files(stages, tmp, name, cfg, checkpoint, tokenizer, tokens)
        write_report(report, tmp, t_start, source, tokenizer)
    summary(report, log)
    return report


def _source_line(source: str) -> str:
    return f"a Hugging Face {source[3:]} folder, converted as it is read" if source.startswith("hf:") else source


def build_graph(source, path: Path, fuse: bool, attention: str = "plain", quantize=None, fold: bool = True,
                verify: bool = True, trained: bool = True, tokens: list[int] | None = None,
                rmsnorm: str = "op") -> BuildReport:
    """One graph of `source` (e.g. models.weights.model_weights(model)) written to `path`: emitted (`rmsnorm`:
    export/emit.py's form of an RMSNorm), folded (fold=False with attention "gqa": ONNX Runtime's rewrites
    alone), quantized, and verified against the torch reference unless verify=False (a quantized graph's
    top-1 floor: a note for trained=False)."""
    from export.verify import ATOL, SCALE_TOL
    key = tolerance_key("fp32", "fp32", quantize)
    report = BuildReport("(in memory)", str(path), "fp32", fuse, attention=attention,
                         verification=Verification(ATOL[key], SCALE_TOL[key]), target=target_of(attention),
                         source=source.source)
    t0 = time.perf_counter()
    proto, lazy = make_graph(source, report, fuse, "fp32", attention, quantize, fold, rmsnorm)
    report.timings_s["graph"] = round(time.perf_counter() - t0, 3)
    report.weight_bytes = write_graph(proto, lazy, Path(path), log=None)
    if verify:
        verify_graph(source, Path(path), report, Stages(report, 0, None), "fp32", quantize, tokens,
                     same_start=attention == "gqa", trained=trained)
    return report


# --- writing ---------------------------------------------------------------------------------------

def write_graph(proto, lazy: dict, path: Path, log=print, groups: int = 0) -> int:
    """Write `proto` to `path` (weights in `<path>.data`), each Lazy weight computed when it is written, block
    by block in the model's order, then let go. Returns the bytes of weights written."""
    import onnx
    from core.onnx_writer import StreamedWeights
    from export.emit import Fp16RangeError
    from graph_passes.lazy import is_placeholder, raw_bytes
    sign_onnx(proto)
    inits = list(proto.graph.initializer)
    order = sorted(range(len(inits)), key=lambda i: (lazy[inits[i].name].group < 0, lazy[inits[i].name].group)
                   if is_placeholder(inits[i]) else (True, 1 << 30))
    group = None
    with StreamedWeights(path) as out:
        for i in order:
            t = inits[i]
            if not is_placeholder(t):
                raw = t.raw_data if t.HasField("raw_data") else onnx.numpy_helper.to_array(t).tobytes()
                out.put_raw(t, raw)
                continue
            w = lazy[t.name]
            if w.group != group and log is not None and group is not None:
                _log_group(log, group, groups, out.bytes)
            group = w.group
            with np.errstate(over="ignore" if w.dtype == np.float16 else "warn"):     # (fp16: refused below instead)
                value = w.load()
            if value.dtype == np.float16 and not np.isfinite(value).all():
                raise Fp16RangeError(t.name, "one past it (after the fold)")
            out.put_raw(t, raw_bytes(w, row_order(value)))
            del value
        if log is not None and group is not None:
            _log_group(log, group, groups, out.bytes)
        out.save(proto)
    return out.bytes


def row_order(value: np.ndarray) -> np.ndarray:
    """The array in row order (ONNX's raw_data layout): a transposed view (graph_passes.lazy.transposed)
    copied by torch's transpose, 1.5-2x numpy's on a real model's matrices (any dtype: as its bytes' ints)."""
    if value.flags.c_contiguous or value.ndim != 2 or not value.flags.f_contiguous:
        return value
    import torch
    ints = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[value.dtype.itemsize]
    flipped = torch.from_numpy(value.T.view(ints)).t().contiguous().numpy()
    return flipped.view(value.dtype)


def _log_group(log, group: int, groups: int, written: int) -> None:
    what = f"block {group + 1}/{groups}" if group >= 0 else "embedding, final norm, head"
    log(f"      {what}: {written / 1e6:,.0f} MB written")


def write_report(report: BuildReport, folder: Path, t_start: float, source, tokenizer: Path | None) -> None:
    """config.json (the checkpoint's own; a converted model's, what was built), tokenizer.json, the chat
    template and the stop tokens (core.generation.MODEL_FILES, where the source has them), then versions, the total time, the file list and report.json itself."""
    from models.checkpoint import CONFIG, TOKENIZER, checkpoint_config
    if source.source == "checkpoint" and source.raw_config.get("max_seq_len") == source.cfg.max_seq_len:
        shutil.copyfile(source.where / CONFIG, folder / CONFIG)
    elif source.source == "checkpoint":     # export.build --max-seq-len: the capacity built, the rest as saved
        (folder / CONFIG).write_text(json.dumps({**source.raw_config, "max_seq_len": source.cfg.max_seq_len},
                                                indent=2) + "\n")
    else:
        (folder / CONFIG).write_text(json.dumps(checkpoint_config(source.skeleton, tokenizer is not None),
                                                indent=2) + "\n")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, folder / TOKENIZER)
    from core.generation import write_model_files
    # chat_template.json and generation.json (the stop tokens): the checkpoint's or the HF folder's
    write_model_files(source.where, folder)
    report.versions = versions()
    report.timings_s["total"] = round(time.perf_counter() - t_start, 3)
    report.files = sorted(p.name for p in folder.iterdir() if p.name != MARKER) + [REPORT]   # (the build's files)
    (folder / REPORT).write_text(json.dumps(report.to_json(), indent=2) + "\n")


def versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


def genai_files(stages: Stages, folder: Path, source: str, cfg, checkpoint: Path, tokenizer, tokens):
    """The stage `genai`: the GenAI graph from `source`, its config and tokenizer files, verified against
    `source` (export/genai.py): an export.genai.GenAIFolder."""
    from export.genai import GENAI_CONFIG, GENAI_GRAPH, genai_stage
    t0 = stages.start(f"genai: {GENAI_GRAPH} ({source} with ONNX Runtime GenAI's I/O), {GENAI_CONFIG}, "
                      "tokenizer files; verify vs " + source)
    info = genai_stage(folder, source, cfg, checkpoint, tokenizer, tokens)
    for note in info.notes:
        stages.log(f"      note: {note}")
    stages.done("genai", t0, f": max |d logits| {info.logits_max_abs_diff:.3g} (atol {info.atol:g})"
                + ("" if info.tokenizer else "; no tokenizer: GenAI applications feed token ids"))
    return info
