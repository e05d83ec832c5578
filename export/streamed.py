"""The build for models too large to hold: `export.build --route streamed` (chosen by itself when the
in-memory build would not fit), in named stages with the same report as export/pipeline.py.

    open the weights (headers only) ─▶ memory estimate (refuse in one line when it cannot fit)
      ─▶ plan the graph (two small proxies, export/stream.py) ─▶ write it, block by block
      ─▶ torch reference, block by block (models/layerwise.py) ─▶ the graph in ONNX Runtime ─▶ compare

One graph is written: model.fused.onnx with --fuse (model.onnx without), or with --quantize only
model.<int8|int4>.onnx (an fp32 copy of a real-size model would cost its whole size in disk, time
and verification memory, and nothing runs it). The graph is verified against the torch reference
of the checkpoint itself (prefill + decode steps on random and real tokens; every logit, and the
cache slots the steps wrote), with the tolerance of its dtype; a quantized graph also by its
top-1 agreement with the reference over those positions. Only one model is alive at a time: the
reference holds one block, then is gone before ONNX Runtime loads the graph.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from core.build_files import FUSED, UNFUSED
from core.inputs import check_memory, human_bytes
from core.outputs import BUILD, check_output_dir, output_dir

GIB = 1 << 30
BASE_BYTES = int(1.5 * GIB)      # interpreter, torch, onnx and ONNX Runtime loaded, allocator slack (measured)


@dataclass
class MemoryEstimate:
    """Peak resident bytes of a build, by what is alive at its largest moment."""
    peak: int
    parts: dict[str, int]

    def line(self) -> str:
        big = max(self.parts, key=self.parts.get)
        return f"~{human_bytes(self.peak)} at its peak ({big}: {human_bytes(self.parts[big])})"


def graph_weight_bytes(cfg, dtype: str, quantize) -> int:
    """Bytes of the weights in the written graph."""
    params = cfg.approx_param_count()
    if quantize is None:
        return params * (4 if dtype == "fp32" else 2)
    per_value = {4: 0.5, 8: 1.0}[quantize.bits] + 4 / quantize.block_size        # data + one fp32 scale a block
    head = cfg.vocab_size * cfg.d_model
    head_bytes = head * ({"int8": 1.0 + 4 / quantize.block_size, "int4": per_value, "fp32": 4.0}[quantize.head_dtype])
    return int((params - head) * per_value + head_bytes)


def streamed_memory(cfg, dtype: str, quantize) -> MemoryEstimate:
    """The streamed build's peak: the largest of its stages, each alone (see the module doc).
    The factors were measured on Llama-3.2-1B-shaped builds (docs/export.md, "Real sizes")."""
    d, hidden, v = cfg.d_model, cfg.hidden, cfg.vocab_size
    block = 4 * (d * cfg.head_dim * (2 * cfg.n_head + 2 * cfg.kv_heads) + (3 if cfg.mlp == "swiglu" else 2) * d * hidden)
    table = 4 * v * d
    head = table                     # the LM head (a copy once the final norm folds into a tied one)
    parts = {
        "writing a block": 3 * block,
        # quantized: ORT's quantizer copies the head a few times, and the reference with the graph's
        # dequantized weights rebuilds both tables (measured: Llama-3-8B's shape, untied, peaked at 14.0 GiB)
        # (+ the half-precision copy of a table while it is cast: measured 4.9-5.3 GB on the 1B shape at bf16)
        "writing and checking the embedding and head": 2 * table + head + (4 * head if quantize is not None else 0)
        + (table // 2 if quantize is None and dtype != "fp32" else 0),
        "the torch reference": 2 * block + table + head,
        # ONNX Runtime's share, measured: GPT-2 medium's fp32 graph (1.6 GB; MatMul weights prepacked)
        # peaked at 3.6 GB, Llama-3.2-1B's (6.0 GB) at 6.6 GB: up to ~1.5 x the graph plus the base
        "ONNX Runtime over the graph": int(1.5 * graph_weight_bytes(cfg, dtype, quantize)),
    }
    return MemoryEstimate(BASE_BYTES + max(parts.values()), parts)


def in_memory_peak(cfg) -> int:
    """The in-memory build's peak (export/pipeline.py): the model is held several times (torch
    module, traced graph, proto, graphsurgeon's copy, folded constants, two sessions); GPT-2
    medium's shape (1.4 GB of fp32 weights) was OOM-killed at 24 GB, i.e. more than 17 copies."""
    return BASE_BYTES + 18 * 4 * cfg.approx_param_count()


def cheaper_option(cfg, dtype: str, quantize) -> str:
    """What would fit: the first of int4, int8, fp16 whose estimate is lower and fits."""
    from core.inputs import available_memory      # looked up when called: tests replace it
    from export.quantize import QuantConfig
    avail = available_memory() or 0
    for label, d, q in (("--quantize int4", "fp32", QuantConfig("int4")), ("--quantize int8", "fp32", QuantConfig("int8")),
                        ("--dtype fp16", "fp16", None)):
        if (label.endswith("fp16") and dtype in ("fp16", "bf16")) or (q is not None and quantize is not None and q.bits >= quantize.bits):
            continue
        if streamed_memory(cfg, d, q).peak <= avail:
            return f"build with {label} (needs ~{human_bytes(streamed_memory(cfg, d, q).peak)})"
    return "use a machine with more memory"


# --- the driver ----------------------------------------------------------------------------------

def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's malloc_trim; nothing elsewhere). The
    reference's blocks are gone by now, but glibc keeps their pages: the Llama-3.2-1B shape's build
    still held ~1.3 GB of them when ONNX Runtime loaded the graph, its largest stage."""
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):    # not glibc (musl, macOS): their allocators differ
        pass


def top1(ref_runs, runs) -> tuple[float, int]:
    """Share of positions (every step, every sequence) where both graphs' argmax agree."""
    same = total = 0
    for rs, gs in zip(ref_runs, runs):
        for r, g in zip(rs, gs):
            a, b = r["logits"].argmax(-1), g["logits"].argmax(-1)
            same += int((a == b).sum())
            total += a.size
    return same / max(total, 1), total


def build_streamed(checkpoint: Path, out: Path, fuse: bool, dtype: str = "fp32", log=print, quantize=None,
                   attention: str = "plain", source=None, genai: bool = False, target_why: str = ""):
    """The streamed build; returns the BuildReport (also OUT/report.json). `source`: the checkpoint's
    weights already opened (models.weights.open_weights), e.g. by the CLI's route choice. `genai`:
    also the ONNX Runtime GenAI folder's files, over the same weights file (export/genai.py).
    `target_why`: why export.build --target auto chose the attention, for the report (export/target.py)."""
    from export.pipeline import (BuildReport, ModelSummary, Stages, check_gate, check_options, genai_files,
                                 real_tokens, summary, worst, write_report)
    from export.target import target_of
    from export.verify import ATOL, SCALE_TOL
    from models.checkpoint import TOKENIZER
    from models.weights import open_weights
    checkpoint, out = Path(checkpoint), Path(out)
    check_output_dir(out, BUILD, inputs=[checkpoint])
    check_options(quantize, genai, fuse, dtype, attention)
    if genai:
        from export.genai import check_tokenizer_files
        check_tokenizer_files(Path(checkpoint))      # the files it would copy for GenAI's tokenizer, before any work
    t_start = time.perf_counter()
    source = source or open_weights(checkpoint)
    cfg = source.cfg
    check_gate(source.skeleton, fuse)
    estimate = streamed_memory(cfg, dtype, quantize)
    check_memory(estimate.peak, f"{checkpoint}: the streamed build of {cfg.approx_param_count() / 1e9:.2f}B parameters",
                 cheaper_option(cfg, dtype, quantize), share=1.0, needs=estimate.line())
    key = quantize.dtype if quantize is not None else dtype
    checked = "dequantized" if quantize is not None and quantize.algo == "rtn" else key
    report = BuildReport(str(checkpoint), str(out), dtype, fuse, atol=ATOL[checked], scale_tol=SCALE_TOL[checked],
                         attention=attention, route="streamed", target=target_of(attention), target_why=target_why)
    gate = source.skeleton.gate.value if cfg.norm == "taper" else None
    report.model = ModelSummary.of(cfg, gate, cfg.approx_param_count())
    report.source, report.notes = source.source, list(source.notes)
    report.memory_estimate = {"peak_bytes": estimate.peak, **estimate.parts}
    stages = Stages(report, 6 if genai else 5, log)
    t0 = stages.start(f"open {checkpoint} ({source.source}): weights read block by block, memory-mapped")
    stages.done("open", t0, f": {cfg.approx_param_count():,} params, {cfg.n_layer} layers; estimated peak "
                f"{estimate.line()}")
    name = quantize.file_name() if quantize is not None else (FUSED if fuse else UNFUSED)
    tokenizer = source.where / TOKENIZER if (source.where / TOKENIZER).is_file() else None
    tokens = real_tokens(tokenizer, cfg.vocab_size)
    with output_dir(out, BUILD, inputs=[checkpoint]) as tmp:
        plan = _plan_and_write(stages, report, source, tmp / name, dtype, fuse, attention, quantize, key)
        checked = _checkable(tmp / name, report, log)
        runs_ref, runs_deq, sessions, iface = _reference(stages, source, plan, checked, dtype, tokens)
        t0 = stages.start(f"verify {checked.name} in ONNX Runtime vs the torch reference"
                          f"{' with its dequantized weights; drift and top-1 vs the float model' if quantize else ''}")
        _verify(report, checked, iface, sessions, runs_ref, runs_deq, quantize, key, log)
        stages.done("verify", t0, f": max |d logits| {worst(report.max_abs_diff['graph_vs_torch'], 'logits'):.3g}")
        if checked != tmp / name:
            checked.unlink()                # our own temporary graph (the weights are the build's)
        if genai:
            report.genai = genai_files(stages, tmp, name, cfg, checkpoint, tokenizer, tokens)
        write_report(report, tmp, t_start, source.where, source.source, source.skeleton, tokenizer)
    summary(report, log)
    return report


def _plan_and_write(stages, report, source, path: Path, dtype: str, fuse: bool, attention: str, quantize, key: str):
    """The stages plan (the graph on two small proxies) and write_graph (the weights, block by block, to `path`)."""
    from export.stream import plan_graph, write_graph
    t0 = stages.start(f"plan {path.name}: {'fold, ' if fuse else ''}{attention} attention"
                      f"{', ' + quantize.dtype if quantize else ''} on two small proxies of the model")
    plan = plan_graph(source, dtype, fuse, attention, quantize)
    stages.done("plan", t0, f": {len(plan.proto.graph.node)} nodes, {len(plan.recipes)} initializers")
    t0 = stages.start(f"write {path.name} (weights read, {'folded, ' if fuse else ''}"
                      f"{'quantized' if quantize else 'cast to ' + dtype} and written block by block)")
    written = write_graph(plan, source, path, stages.log)
    stages.done("write_graph", t0, f": {written / 1e9:.2f} GB of weights")
    _record_graph(report, plan, source, fuse, key)
    if quantize is not None:
        report.quantized["weight_bytes_after"] = written
    return plan


def _record_graph(report, plan, source, fuse: bool, key: str) -> None:
    from export.pipeline import NORM_OPS, Fold
    from graph_passes.base import op_counts
    kind = "fused" if fuse else "unfused"
    report.op_counts[kind] = op_counts(plan.proto)
    report.norm_layers[kind] = [n.name for n in plan.proto.graph.node if n.op_type in NORM_OPS]
    if fuse:
        from models.fold import folded_norm_names
        report.folded = [Fold("models.fold", n, "affine part folded into the adjacent linear(s) while streaming")
                         for n in folded_norm_names(source.skeleton)]
    if plan.quantize is not None:
        ops = report.op_counts[kind]
        report.quantized = {"file": plan.quantize.file_name(), "config": asdict(plan.quantize),
                            "matmuls_quantized": ops.get("MatMulNBits", 0), "matmuls_left": ops.get("MatMul", 0),
                            "gathers_quantized": ops.get("GatherBlockQuantized", 0), "head": plan.quantize.head_dtype,
                            "weight_bytes_before": source.weight_bytes(),
                            **{k: getattr(plan.quantized, k) for k in ("tied_table", "notes", "rewritten")}}


def _checkable(path: Path, report, log) -> Path:
    """The graph ONNX Runtime's CPU can run: itself, or for bf16 its widened copy (export/bfloat16.py)."""
    from core.contract import contract_of
    if contract_of(path).dtype != "bf16":
        return path
    from export.bfloat16 import widened_copy
    line = (f"{path.name} is bf16, which ONNX Runtime's CPU kernels do not compute: verified as its widened "
            "copy (the same graph and bf16 weights, each weight cast to fp32 where it is read; activations "
            "in fp32) against the fp32 torch reference; bf16 arithmetic itself runs in bench/gpu_check.sh")
    report.notes.append(line)
    log(f"      note: {line}")
    return widened_copy(path)


def _reference(stages, source, plan, path: Path, dtype: str, tokens: list[int] | None):
    """The torch references, one block at a time, on the verification sessions: the checkpoint's
    model, and for a quantized graph also the folded model with the graph's dequantized weights
    (export/quant_reference.py; None where its blocks carry zero points)."""
    from core.contract import contract_of
    from export.conventions import verification_sessions
    from export.quant_reference import QuantizedParts
    from models.decoder import TORCH_DTYPES
    from models.layerwise import layerwise_run
    iface = contract_of(path)
    # batched prefills from slot 0: what every graph kind takes
    sessions = verification_sessions(iface, tokens, same_start=True)
    steps = [s for _, s in sessions]
    t0 = stages.start(f"torch reference, block by block ({len(sessions)} sessions: prefill + decode steps"
                      f"{'; and with the graph dequantized weights' if plan.quantize is not None else ''})")
    # the reference computes in the graph's dtype; a bf16 graph is checked widened (_checkable), so against fp32
    runs = layerwise_run(source, steps, TORCH_DTYPES["fp32" if dtype == "bf16" else dtype], log=stages.log)
    dequantized = None
    if plan.quantize is not None and plan.quantize.algo == "rtn":
        stages.log("      and with the graph's dequantized weights:")
        dequantized = layerwise_run(source, steps, parts=QuantizedParts(source, plan), log=stages.log)
    stages.done("reference", t0)
    release_freed_memory()
    return runs, dequantized, sessions, iface


def _verify(report, path: Path, iface, sessions, runs_ref, runs_deq, quantize, key: str, log) -> None:
    """The graph against the references: its dtype's tolerance against the checkpoint's model (float
    graphs), DEQUANTIZED_ATOL against the dequantized one (quantized graphs), where the drift from
    the float model and the top-1 agreement with it are measured and reported."""
    from export.conventions import run_onnx
    from export.pipeline import quantized_drift
    from export.quantize import MIN_TOP1
    from export.verify import DEQUANTIZED, VerificationError, compare_sessions, ort_session
    from models.layerwise import used_slots
    sess = ort_session(path)
    runs = []
    for k, (label, steps) in enumerate(sessions):
        runs.append(run_onnx(sess, iface, steps, trim=used_slots(steps)))
        log(f"      [{k + 1}/{len(sessions)}] {label}: {len(steps)} steps run")
    del sess
    exact = quantize is not None and runs_deq is not None       # against its own dequantized weights
    refs, tolerance, what = (runs_deq, DEQUANTIZED, " with its dequantized weights") if exact else (runs_ref, key, "")
    results = compare_sessions(sessions, refs, runs, tolerance, f"{path.name} vs torch{what}")
    report.max_abs_diff["graph_vs_torch"] = {c.what: c.max_abs_diff for c in results}
    if quantize is None:
        return
    agree, n = top1(runs_ref, runs)
    report.quantized["drift"] = quantized_drift(runs_ref, runs, agree, n,
                                                "the verification sessions, teacher-forced, vs the float model")
    report.quantized["tolerance"] = {"atol": report.atol, "scale_tol": report.scale_tol,
                                     "min_top1": MIN_TOP1[quantize.dtype],
                                     "checked_against": "dequantized weights" if runs_deq is not None else "float model"}
    if agree < MIN_TOP1[quantize.dtype]:
        line = (f"top-1 agreement with the float model {agree:.1%} over {n} positions < {MIN_TOP1[quantize.dtype]:.0%} "
                f"(the {quantize.dtype} floor of a trained model); try --head int8, --block-size 16, or int8")
        if runs_deq is None:
            raise VerificationError(f"{path.name} vs torch", [line])
        report.notes.append(line)       # the graph is exact (checked above); its quality is the model's and the dtype's
        log(f"      note: {line}")
