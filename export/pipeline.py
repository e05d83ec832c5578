"""The build behind `python -m export.build`: one route for every size, in named stages with a typed report.

    open the weights (headers only) ─▶ memory estimate (refuse in one line when it cannot fit)
      ─▶ emit the graph from the model's spec (export/emit.py: every matrix a Lazy, unread)
      ─▶ [fold: graph_passes, each fold recorded on the weight it changes] ─▶ [quantize: graph_passes/quantized.py]
      ─▶ write: each weight read, folded, cast or quantized and written, one at a time (write_graph)
      ─▶ the torch reference, block by block (models/layerwise.py) ─▶ the graph in ONNX Runtime ─▶ compare
      ─▶ [--genai: GenAI's folder] ─▶ config.json, tokenizer.json, report.json

One graph is written: model.onnx (no --fuse), model.fused.onnx (--fuse) or model.<int8|int4>.onnx
(--quantize). The same stages build a 1M model and an 8B one: the weights flow once, from the
memory-mapped checkpoint through the passes' recorded arithmetic into the graph's external data, and
nothing holds the model whole; only one model is alive at a time (the reference holds one block, then
is gone before ONNX Runtime loads the graph). graph_passes is the one place that folds and rewrites.

Verification: the written graph against the torch reference of the checkpoint itself (prefill + decode
steps on random and real tokens; every logit, and the cache slots the steps wrote), with the tolerance
of its dtype (export/verify.py); fp32 also allows what torch's own fp32 rounding is on those inputs when
the fixed tolerance is exceeded (a float64 reference, run only then). A quantized graph is checked
against the folded model holding the graph's own dequantized weights (GraphWeights: what is left is
how MatMulNBits computes), and its drift and top-1 agreement against the float model are reported
(a trained model's top-1 below MIN_TOP1 fails the build).

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
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from core.build_files import FUSED, REPORT, UNFUSED
from core.errors import UsageError, UserError
from core.inputs import check_memory, human_bytes
from core.outputs import BUILD, MARKER, check_output_dir, output_dir, sign_onnx
from export.target import Target, target_of

NORM_OPS = ("RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization")
REAL_TEXT = ("Once upon a time there was a little girl named Lily. She loved to play in the garden "
             "with her red ball, and one day she saw a big dog under the tall tree.")
GIB = 1 << 30
BASE_BYTES = int(1.5 * GIB)      # interpreter, torch, onnx and ONNX Runtime loaded, allocator slack (measured)


class BuildError(UserError):
    """A build that cannot proceed; the message is one line for the user."""


@dataclass
class ModelSummary:
    norm: str
    taper_scope: str | None
    gate: float | None
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    capacity: int
    tie_embeddings: bool
    params: int
    n_kv_head: int = 0
    pos_embedding: str = "learned"

    @classmethod
    def of(cls, cfg, gate: float | None, params: int) -> "ModelSummary":
        return cls(cfg.norm, cfg.taper_scope, gate, cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size,
                   cfg.max_seq_len, cfg.tie_embeddings, params, cfg.kv_heads, cfg.pos_embedding)


@dataclass
class Fold:
    pass_name: str      # the graph pass that folded it
    layer: str
    detail: str


@dataclass
class BuildReport:
    """What one build did; written as OUT/report.json (layout in docs/export.md)."""
    checkpoint: str
    out: str
    dtype: str
    fuse: bool
    attention: str = "plain"                # plain ops | fused (one ONNX Attention op per layer) | gqa (ORT's op)
    model: ModelSummary | None = None
    graph: str = ""                         # the graph file written
    files: list[str] = field(default_factory=list)
    op_counts: dict[str, dict[str, int]] = field(default_factory=dict)      # emitted / <graph kind> -> op -> count
    norm_layers: dict[str, list[str]] = field(default_factory=dict)         # layers whose norm op remains
    folded: list[Fold] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    trt_lint: list[str] = field(default_factory=list)
    atol: float = 0.0
    scale_tol: float = 0.0
    max_abs_diff: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # graph_vs_torch -> session -> output
    timings_s: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    source: str = "checkpoint"           # checkpoint | hf:<model_type> (converted as read) | in-memory
    eps_approximation: dict | None = None  # disabled norms: models.disabled_norm.EpsApproximation
    quantized: dict = field(default_factory=dict)      # --quantize: what was quantized, tolerance, drift
    memory_estimate: dict | None = None  # the estimated peak and its parts, bytes
    weight_bytes: int = 0                # bytes of weights written
    genai: dict = field(default_factory=dict)      # --genai: the GenAI graph, its config, tokenizer files, check
    target: str = ""                     # ort-cpu | portable: the runtime the graphs are for (export/target.py)
    target_why: str = ""                 # why --target auto chose it
    kv_cache: str = "fp32"               # the KV caches' dtype (--kv-cache; fp16: GroupQueryAttention graphs)
    # a Hugging Face folder: our torch model (the reference above) against transformers' own forward, or why
    # it was skipped (transformers_check below)
    transformers_vs_ours: dict = field(default_factory=dict)

    @property
    def norm_ops(self) -> dict[str, int]:
        return {k: sum(v.get(op, 0) for op in NORM_OPS) for k, v in self.op_counts.items()}

    def to_json(self) -> dict:
        d = asdict(self)
        d["folded"] = [{"pass": f.pass_name, "layer": f.layer, "detail": f.detail} for f in self.folded]
        d["norm_ops"] = self.norm_ops
        return d


class Stages:
    """Progress lines `[i/n] what` and per-stage timings, in the report (log None: the timings alone)."""

    def __init__(self, report: BuildReport, n: int, log):
        self.report, self.n, self.log, self.i = report, n, log, 0

    def start(self, msg: str) -> float:
        self.i += 1
        if self.log is not None:
            self.log(f"[{self.i}/{self.n}] {msg}")
        return time.perf_counter()

    def done(self, key: str, t0: float, extra: str = "") -> None:
        self.report.timings_s[key] = round(time.perf_counter() - t0, 3)
        if self.log is not None:
            self.log(f"      {self.report.timings_s[key]:.1f} s{extra}")


# --- checks before any work ----------------------------------------------------------------------

def check_gate(model, fuse: bool) -> None:
    """--fuse folds a TaperNorm only at gate 0: refuse a model (or a weights source's skeleton) before any work."""
    if fuse and model.cfg.norm == "taper" and model.gate.value != 0.0:
        raise BuildError(f"{', '.join(model.taper_layers())}: TaperNorm gate {model.gate.value:g}; --fuse needs gate 0 "
                         "(finish the taper, or build without --fuse)")


def check_dtype(cfg, dtype: str) -> None:
    """A disabled (FakeLN-style) norm's eps overflows fp16: refuse before any work."""
    from models.checkpoint import DISABLED_NORM_EPS
    if dtype != "fp16":
        return
    eps = {name: cfg.eps_of(name) for name in cfg.norm_names() if cfg.eps_of(name) >= DISABLED_NORM_EPS}
    if eps:
        raise BuildError(f"{', '.join(eps)}: norm eps {max(eps.values()):g} >= {DISABLED_NORM_EPS:g} is a disabled "
                         f"(FakeLN-style) norm and overflows fp16 (max 65504); build with --dtype fp32")


def check_options(quantize, genai: bool, fuse: bool, dtype: str, attention: str, kv_cache: str = "fp32") -> None:
    """Every combination of build options refused before any work, in this order (each names its option)."""
    from export.genai import check_genai
    check_quantize(quantize, fuse, dtype)
    check_genai(genai, fuse, dtype, attention)      # before check_attention: it names the option the user gave
    check_attention(attention, fuse, dtype)
    check_kv_cache(kv_cache, attention, genai)


def check_kv_cache(kv_cache: str, attention: str, genai: bool) -> None:
    """--kv-cache fp16 is GroupQueryAttention's (graph_passes/ort_attention.py's with_cache_dtype): refuse it
    for the portable graph and for GenAI's folder (not verified there)."""
    if kv_cache == "fp32":
        return
    if attention != "gqa":
        raise UsageError(f"--kv-cache {kv_cache}: expected the ONNX Runtime CPU graph (--target ort-cpu: "
                         f"GroupQueryAttention), found {attention} attention (--target portable); add --fuse "
                         "--target ort-cpu, or drop --kv-cache")
    if genai:
        raise UsageError(f"--kv-cache {kv_cache}: expected a build without --genai (GenAI's folder keeps an fp32 "
                         "cache), found --genai; drop one of them")


def require_fused_fp32(option: str, fuse: bool, dtype: str, why_fuse: str, why_fp32: str,
                       fix: str = "drop --dtype") -> None:
    """An option that works on the folded fp32 graph: refuse it (UsageError) without --fuse or at another dtype."""
    if not fuse:
        raise UsageError(f"{option}: expected --fuse too ({why_fuse}); add --fuse")
    if dtype != "fp32":
        raise UsageError(f"{option}: expected --dtype fp32 ({why_fp32}), found --dtype {dtype}; {fix}")


def check_attention(attention: str, fuse: bool, dtype: str) -> None:
    """--attention gqa rewrites the folded fp32 graph for ONNX Runtime's CPU kernel: refuse other combinations."""
    if attention == "gqa":
        require_fused_fp32("--attention gqa", fuse, dtype, "the GroupQueryAttention rewrite runs after the fold",
                           "ONNX Runtime's CPU GroupQueryAttention is fp32 only",
                           "drop --dtype or use --attention fused")


def check_quantize(quantize, fuse: bool, dtype: str) -> None:
    """--quantize quantizes the folded fp32 graph: refuse other combinations before any work."""
    if quantize is not None:
        require_fused_fp32(f"--quantize {quantize.dtype}", fuse, dtype, "the folded graph is what gets quantized",
                           "weights are quantized from fp32")
        quantize.validate()


def verified_as(dtype: str, cache: str) -> str:
    """The tolerance key of a float graph: its dtype, or fp16's for an fp32 graph with an fp16 cache (an fp16
    cache is one of the roundings a whole fp16 graph has; the caches it writes are fp16 values)."""
    return "fp16" if dtype == "fp32" and cache == "fp16" else dtype


# --- memory ----------------------------------------------------------------------------------------

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


def build_memory(cfg, dtype: str, quantize) -> MemoryEstimate:
    """The build's peak: the largest of its stages, each alone (see the module doc). The factors were
    measured on Llama-3.2-1B- and Llama-3-8B-shaped builds (docs/export.md, "Real sizes")."""
    d, hidden, v = cfg.d_model, cfg.hidden, cfg.vocab_size
    block = 4 * (d * cfg.head_dim * (2 * cfg.n_head + 2 * cfg.kv_heads) + (3 if cfg.mlp == "swiglu" else 2) * d * hidden)
    table = 4 * v * d
    parts = {
        # one weight at a time: read (fp32), transposed, folded in float64, cast or quantized
        "writing a weight": 4 * table,
        # the reference holds one block, the table and the head; a quantized graph's reference also the
        # dequantized copies of both tables
        "the torch reference": 2 * block + 2 * table + (2 * table if quantize is not None else 0),
        # ONNX Runtime's share, measured: GPT-2 medium's fp32 graph (1.6 GB; MatMul weights prepacked)
        # peaked at 3.6 GB, Llama-3.2-1B's (6.0 GB) at 6.6 GB: up to ~1.5 x the graph plus the base
        "ONNX Runtime over the graph": int(1.5 * graph_weight_bytes(cfg, dtype, quantize)),
    }
    return MemoryEstimate(BASE_BYTES + max(parts.values()), parts)


def transformers_check_bytes(cfg) -> int:
    """The peak of the transformers check (transformers_check): the model whole twice in fp32, transformers'
    and ours, on top of BASE_BYTES; it runs after the build's own stages have released theirs."""
    return BASE_BYTES + 2 * 4 * cfg.approx_param_count()


def cheaper_option(cfg, dtype: str, quantize) -> str:
    """What would fit: the first of int4, int8, fp16 whose estimate is lower and fits."""
    from core.inputs import available_memory      # looked up when called: tests replace it
    from export.quantize import QuantConfig
    avail = available_memory() or 0
    for label, d, q in (("--quantize int4", "fp32", QuantConfig("int4")), ("--quantize int8", "fp32", QuantConfig("int8")),
                        ("--dtype fp16", "fp16", None)):
        if (label.endswith("fp16") and dtype in ("fp16", "bf16")) or (q is not None and quantize is not None and q.bits >= quantize.bits):
            continue
        if build_memory(cfg, d, q).peak <= avail:
            return f"build with {label} (needs ~{human_bytes(build_memory(cfg, d, q).peak)})"
    return "use a machine with more memory"


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's malloc_trim; nothing elsewhere). The
    reference's blocks are gone by then, but glibc keeps their pages: the Llama-3.2-1B shape's build
    still held ~1.3 GB of them when ONNX Runtime loaded the graph, its largest stage."""
    import ctypes
    import ctypes.util
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):    # not glibc (musl, macOS): their allocators differ
        pass


# --- the graph: emit, fold, quantize ---------------------------------------------------------------

def graph_name(fuse: bool, quantize) -> str:
    return quantize.file_name() if quantize is not None else (FUSED if fuse else UNFUSED)


def make_graph(source, report: BuildReport, fuse: bool, dtype: str, attention: str, quantize=None,
               fold: bool = True, rmsnorm: str = "op", kv_cache: str = "fp32"):
    """The graph of `source` (a models.weights.WeightSource) and its Lazy weights: emitted, folded (fuse; with
    attention "gqa" also ONNX Runtime's rewrites; fold=False: those alone), quantized. Nothing is read
    but the norms' vectors; the folds and the quantization run on each weight when it is written."""
    from export.emit import emit_graph
    emitted = emit_graph(source, dtype, "fused" if attention == "gqa" else attention, rmsnorm)
    proto, lazy = emitted.proto, emitted.lazy
    graph_stats(report, "emitted", proto)
    if fuse or attention == "gqa":
        proto = fuse_stage(proto, lazy, report, attention, fold)
    if quantize is not None:
        from export.quantize import quantize_weights
        proto, summary = quantize_weights(proto, quantize, lazy)
        report.quantized = {"file": quantize.file_name(), **asdict(summary)}
    if dtype == "bf16":                 # the weights, folded in fp32, rounded to bf16 once
        from export.bfloat16 import bf16_graph
        proto = bf16_graph(proto, lazy, emitted.fp32)
    if kv_cache != "fp32":              # (check_kv_cache: a GroupQueryAttention graph)
        from graph_passes.ort_attention import with_cache_dtype
        proto = with_cache_dtype(proto, kv_cache)
    graph_stats(report, report_kind(fuse, quantize), proto)
    return proto, lazy


def fuse_stage(proto, lazy: dict, report: BuildReport, attention: str = "plain", fold: bool = True):
    """Run the default passes (and with attention "gqa" the ONNX Runtime rewrite); every TaperNorm
    must fold and every layer's attention must become GroupQueryAttention (a leftover is an
    error, with the reasons). fold=False: the ONNX Runtime rewrites alone, norms left as emitted
    (with attention "gqa": an unfolded graph on the same attention kernel, bench's unfused variants)."""
    from graph_passes import passes_for, run_passes
    from graph_passes.registry import ORT_PASSES
    fused, results = run_passes(proto, passes_for(attention) if fold else ORT_PASSES, lazy)
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
    leftover = _leftover_taper(fused) if fold else []
    if leftover:
        why = "; ".join(report.notes) or "no matching pattern"
        raise BuildError(f"{', '.join(leftover)}: TaperNorm left unfolded ({why})")
    return fused


def _leftover_taper(proto) -> list[str]:
    """TaperNorm nodes still in a fused graph (by their provenance)."""
    from graph_passes.base import PassContext
    ctx = PassContext(proto)
    return sorted({ctx.layer_name(n) for n in ctx.graph.nodes
                   if any(c.endswith(".TaperNorm") for c in ctx.module_class(n))})


def graph_stats(report: BuildReport, kind: str, proto) -> None:
    """The graph's op counts and the layers of the normalization ops left in it."""
    from graph_passes.base import PassContext, op_counts
    report.op_counts[kind] = op_counts(proto)
    ctx = PassContext(proto)
    report.norm_layers[kind] = [ctx.layer_name(n) for n in ctx.graph.nodes if n.op in NORM_OPS]


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


# --- verification ----------------------------------------------------------------------------------

def real_tokens(tokenizer: Path | None, vocab_size: int) -> list[int] | None:
    """REAL_TEXT by the model's tokenizer.json, ids inside the vocabulary (None: no tokenizer, or
    nothing usable): the verification's real-text session."""
    if tokenizer is None:
        return None
    from models.checkpoint import load_tokenizer
    return [i for i in load_tokenizer(Path(tokenizer).parent).encode(REAL_TEXT).ids if i < vocab_size] or None


def checkable(path: Path, report: BuildReport, log) -> Path:
    """The graph ONNX Runtime's CPU can run: itself, or for bf16 its widened copy (export/bfloat16.py)."""
    from core.contract import contract_of
    if contract_of(path).dtype != "bf16":
        return path
    from export.bfloat16 import widened_copy
    line = (f"{path.name} is bf16, which ONNX Runtime's CPU kernels do not compute: verified as its widened "
            "copy (the same graph and bf16 weights, each weight cast to fp32 where it is read; activations "
            "in fp32) against the fp32 torch reference; bf16 arithmetic itself runs in bench/gpu_check.sh")
    report.notes.append(line)
    if log is not None:
        log(f"      note: {line}")
    return widened_copy(path)


def top1(ref_runs, runs) -> tuple[float, int]:
    """Share of positions (every step, every sequence) where both runs' argmax agree."""
    same = total = 0
    for rs, gs in zip(ref_runs, runs):
        for r, g in zip(rs, gs):
            a, b = r["logits"].argmax(-1), g["logits"].argmax(-1)
            same += int((a == b).sum())
            total += a.size
    return same / max(total, 1), total


def quantized_drift(float_runs, runs, agree: float, n: int, prompt: str) -> dict:
    """report.quantized["drift"]: the quantized graph's logits against the float model's, and the top-1
    agreement (`agree` over `n` positions of `prompt`)."""
    from export.quantize import logits_diff
    worst_logits, mean_logits, ref_scale = logits_diff(float_runs, runs)
    return {"logits_max_abs_diff": worst_logits, "logits_mean_abs_diff": mean_logits, "logits_max_abs_fused": ref_scale,
            "top1_agreement": agree, "top1_positions": n, "top1_prompt": prompt}


def verify_graph(source, path: Path, report: BuildReport, stages: Stages, dtype: str, quantize,
                 tokens: list[int] | None, same_start: bool, trained: bool = True) -> None:
    """The written graph against the torch reference, block by block (see the module doc); into
    report.max_abs_diff["graph_vs_torch"] (and report.quantized for a quantized graph)."""
    from core.contract import contract_of
    from export.conventions import run_onnx, verification_sessions
    from export.verify import DEQUANTIZED, VerificationError, compare_sessions, ort_session
    from models.decoder import TORCH_DTYPES
    from models.layerwise import layerwise_run, used_slots
    log = stages.log
    checked = checkable(path, report, log)
    iface = contract_of(checked)
    sessions = verification_sessions(iface, tokens, same_start=same_start)
    steps = [s for _, s in sessions]
    t0 = stages.start(f"torch reference, block by block ({len(sessions)} sessions: prefill + decode steps"
                      f"{'; and with the graph dequantized weights' if quantize is not None else ''})")
    # the reference computes in the graph's dtype; a bf16 graph is checked widened, so against fp32
    torch_dtype = TORCH_DTYPES["fp32" if dtype == "bf16" else dtype]
    agreement = agreement_steps(tokens, iface) if quantize is not None else []
    runs_ref = layerwise_run(source, steps + agreement, torch_dtype, log=log)
    runs_ref, agreement_ref = runs_ref[:len(steps)], runs_ref[len(steps):]
    runs_deq = None
    if quantize is not None and quantize.algo == "rtn":
        from export.quant_reference import GraphWeights
        if log is not None:
            log("      and with the graph's dequantized weights:")
        runs_deq = layerwise_run(source, steps, parts=GraphWeights(source, checked), log=log)
    stages.done("reference", t0)
    release_freed_memory()
    t0 = stages.start(f"verify {path.name} in ONNX Runtime vs the torch reference"
                      f"{' with its dequantized weights; drift and top-1 vs the float model' if quantize else ''}")
    sess = ort_session(checked)
    runs = [run_onnx(sess, iface, s, trim=used_slots(s)) for s in steps]
    agreement_runs = [run_onnx(sess, iface, s, trim=used_slots(s)) for s in agreement]
    del sess
    exact = runs_deq is not None                      # against its own dequantized weights
    refs = runs_deq if exact else runs_ref
    key = (DEQUANTIZED if exact else quantize.dtype) if quantize is not None else verified_as(dtype, iface.dtype)
    what = f"{path.name} vs torch{' with its dequantized weights' if exact else ''}"
    try:
        results = compare_sessions(sessions, refs, runs, key, what)
    except VerificationError:
        if key != "fp32":
            raise
        # fp32 past the fixed tolerance: allow what torch's own fp32 rounding is on these inputs (float64 reference)
        exact64 = layerwise_run(source, steps, __import__("torch").float64)
        results = compare_sessions(sessions, refs, runs, key, what,
                                   slacks=[rounding_slack_of(r, e) for r, e in zip(refs, exact64)])
        report.notes.append("fp32: compared with torch's own fp32 rounding as slack (a float64 reference was run)")
    report.max_abs_diff["graph_vs_torch"] = {c.what: c.max_abs_diff for c in results}
    stages.done("verify", t0, f": max |d logits| {worst(report.max_abs_diff['graph_vs_torch'], 'logits'):.3g}")
    if quantize is not None:
        text = agreement_ref or runs_ref, agreement_runs or runs       # real text when there is some
        _quantized_quality(report, quantize, runs_ref, runs, text, exact, trained, path.name, log)
    if checked != path:
        checked.unlink()                # our own temporary graph (the weights are the build's)


TRANSFORMERS_TOKENS, TRANSFORMERS_STEPS = 12, 4     # the transformers check: a prefill, then cached one-token steps


def _transformers_skip(cfg) -> str | None:
    """Why the transformers check cannot run here (None: it can)."""
    from core.inputs import available_memory      # looked up when called: tests replace it
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install transformers to compare with it)"
    need, avail = transformers_check_bytes(cfg), available_memory()
    if avail is not None and need > avail:
        return (f"the model held twice (transformers' and ours, fp32) needs ~{human_bytes(need)}, this machine has "
                f"{human_bytes(avail)} available")
    return None


def transformers_check(source, report: BuildReport, log, tokens: list[int] | None) -> None:
    """A Hugging Face folder: our torch model (the reference graph_vs_torch checked the graph against) against
    transformers' own forward of the same folder, so that the build is checked against an outside reference and
    not only against our own reading of the config (issue 42: a lost rope base passed graph_vs_torch). A prefill,
    then TRANSFORMERS_STEPS one-token steps through each side's KV cache, real text when there is some; the fp32
    tolerance of export/verify.py whatever the graph's dtype (both sides run in fp32). Skipped, saying why, when
    transformers is missing or the two models would not fit in memory at once (transformers_check_bytes) or it
    cannot load the folder; a mismatch fails the build (BuildError, one line). Into report.transformers_vs_ours."""
    if not source.source.startswith("hf:"):
        return
    from export.verify import ATOL, SCALE_TOL
    cfg = source.cfg
    skip = _transformers_skip(cfg)
    if skip is None:
        t0 = time.perf_counter()
        try:
            found = _transformers_vs_ours(source, tokens, lambda scale: ATOL["fp32"] + SCALE_TOL["fp32"] * scale)
        except _TransformersCannot as e:
            skip = str(e)
        else:
            report.timings_s["transformers"] = round(time.perf_counter() - t0, 3)
    if skip is not None:
        report.transformers_vs_ours = {"skipped": skip}
        if log is not None:
            log(f"      transformers_vs_ours skipped: {skip}")
        return
    diff, scale, prefill, steps, slack = found
    tol = ATOL["fp32"] + SCALE_TOL["fp32"] * scale + slack
    report.transformers_vs_ours = {"logits_max_abs_diff": diff, "max_abs_ref": scale, "prefill_tokens": prefill,
                                   "cached_steps": steps, "atol": ATOL["fp32"], "scale_tol": SCALE_TOL["fp32"],
                                   "transformers": __import__("transformers").__version__}
    if slack:
        report.transformers_vs_ours["rounding_slack"] = slack
    if log is not None:
        log(f"      {transformers_line(report.transformers_vs_ours)}")
    if not diff <= tol:     # (NaN too)
        extra = f" + rounding slack {slack:.3g}" if slack else ""
        raise BuildError(f"{source.where}: transformers_vs_ours: expected the converted model's logits within {tol:.3g} "
                         f"of transformers' own (atol {ATOL['fp32']:g} + {SCALE_TOL['fp32']:g} x max|ref| {scale:.3g}"
                         f"{extra}; prefill {prefill} tokens + {steps} cached steps), found max |d| {diff:.3g}; the converter "
                         "reads this config.json otherwise than transformers does: nothing was written, report it "
                         "with the folder's config.json")


def transformers_line(t: dict) -> str:
    """The report's line of the transformers check."""
    if "skipped" in t:
        return f"transformers_vs_ours skipped: {t['skipped']}"
    slack = f" + rounding slack {t['rounding_slack']:.3g}" if t.get("rounding_slack") else ""
    return (f"transformers_vs_ours max |d logits| {t['logits_max_abs_diff']:.3g} (prefill {t['prefill_tokens']} tokens "
            f"+ {t['cached_steps']} cached steps; atol {t['atol']:g} + {t['scale_tol']:g} x max|ref| "
            f"{t['max_abs_ref']:.3g}{slack}; transformers {t['transformers']})")


class _TransformersCannot(Exception):
    """transformers cannot load or run the folder (its version, its own checks): the check is skipped."""


def _transformers_vs_ours(source, tokens: list[int] | None, tolerance) -> tuple[float, float, int, int, float]:
    """(max |d logits|, max |transformers' logits|, prefill tokens, cached steps, rounding slack) of the check.
    Past `tolerance(max |transformers' logits|)`, transformers runs again in float64 (its model converted in
    place: no more memory than the two fp32 models): the slack is FP32_ROUNDING_SLACK times its own fp32
    rounding on these tokens, as the build's verification allows (export/verify.py)."""
    import contextlib
    import copy
    import io
    import warnings

    import torch
    from core.errors import first_line
    cfg = source.cfg
    total = min(TRANSFORMERS_TOKENS, cfg.max_seq_len)
    steps = min(TRANSFORMERS_STEPS, total - 1)
    ids = np.resize(np.asarray(tokens, np.int64), total) if tokens else \
        np.random.default_rng(0).integers(0, cfg.vocab_size, total)
    ids = torch.from_numpy(ids % cfg.vocab_size).long()[None]                           # [1, total]
    prefill = total - steps
    model = source.fill(copy.deepcopy(source.skeleton), "").eval()
    for rotary in model.rotaries().values():       # non-persistent buffers: to_empty left them unset
        rotary.reset_parameters()
    with torch.no_grad():
        cache = cfg.cache_layout().allocate(1)
        logits, cache = model(ids[:, :prefill], torch.zeros(1, dtype=torch.long), cache)
        ours = [logits]
        for t in range(prefill, total):
            logits, cache = model(ids[:, t:t + 1], torch.full((1,), t), cache)
            ours.append(logits)
    del model, cache
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    quiet = contextlib.redirect_stderr(io.StringIO())
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with quiet, warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            try:
                hf = AutoModelForCausalLM.from_pretrained(source.where, dtype=torch.float32).eval()
            except Exception as e:      # its version or its own checks: not ours to judge
                raise _TransformersCannot(f"transformers cannot load {source.where} ({first_line(e)[:200]})") from None
            want = transformers_cached_logits(hf, ids, prefill).double()
            got = torch.cat(ours, 1).double()
            diff, scale, slack = float((got - want).abs().max()), float(want.abs().max()), 0.0
            if not diff <= tolerance(scale):
                from export.verify import FP32_ROUNDING_SLACK
                slack = FP32_ROUNDING_SLACK * float((want - transformers_cached_logits(hf.double(), ids, prefill)).abs().max())
    finally:
        hf_logging.set_verbosity(level)
    return diff, scale, prefill, steps, slack


def transformers_cached_logits(hf, ids, prefill: int):
    """transformers' logits [B, T, V]: a prefill, then one token a call over its own cache (the build's
    transformers_vs_ours check and the tests that compare with transformers)."""
    import torch
    out = hf(ids[:, :prefill], use_cache=True)
    ref, past = [out.logits], out.past_key_values
    for t in range(prefill, ids.shape[1]):
        out = hf(ids[:, t:t + 1], past_key_values=past, use_cache=True)
        ref.append(out.logits)
        past = out.past_key_values
    return torch.cat(ref, 1)


def rounding_slack_of(ref: list[dict], exact: list[dict]) -> dict[str, float]:
    """Per output, FP32_ROUNDING_SLACK x max |reference fp32 - reference float64| over a session's steps: what
    rounding alone can move that output by on these inputs (export/verify.py)."""
    from export.verify import FP32_ROUNDING_SLACK
    out: dict[str, float] = {}
    for r32, r64 in zip(ref, exact):
        for name, value in r32.items():
            diff = float(np.nanmax(np.abs(value.astype(np.float64) - r64[name]))) if value.size else 0.0
            out[name] = max(out.get(name, 0.0), FP32_ROUNDING_SLACK * diff)
    return out


def agreement_steps(tokens: list[int] | None, iface) -> list:
    """The session the top-1 agreement of a quantized graph is taken over: one prefill of real text
    (AGREEMENT_TOKENS positions, the text repeated to fill them) from slot 0; none without text."""
    from core.decode import Step
    from export.quantize import AGREEMENT_TOKENS
    if not tokens:
        return []
    n = max(1, min(AGREEMENT_TOKENS, iface.capacity))
    ids = np.resize(np.asarray(tokens, np.int64) % iface.vocab_size, n)[None]         # [1, n]
    return [[Step(ids, np.zeros(1, np.int64))]]


def _quantized_quality(report: BuildReport, quantize, runs_ref, runs, text, exact: bool, trained: bool, name: str,
                       log) -> None:
    """Drift (on the verification sessions) and top-1 agreement (on `text`: the real-text session's float and
    quantized runs, else the verification sessions) against the float model; below MIN_TOP1 a graph that
    could not be checked against its own dequantized weights fails when the model is trained."""
    from export.quantize import MIN_TOP1
    from export.verify import ATOL, DEQUANTIZED, SCALE_TOL, VerificationError
    agree, n = top1(*text)
    what = "real text" if text[0] is not runs_ref else "the verification sessions"
    report.quantized["drift"] = quantized_drift(runs_ref, runs, agree, n, f"{what}, teacher-forced, vs the float model")
    key = DEQUANTIZED if exact else quantize.dtype
    report.quantized["tolerance"] = {"atol": ATOL[key], "scale_tol": SCALE_TOL[key], "min_top1": MIN_TOP1[quantize.dtype],
                                     "checked_against": "dequantized weights" if exact else "float model"}
    if agree >= MIN_TOP1[quantize.dtype]:
        return
    line = (f"top-1 agreement with the float model {agree:.1%} over {n} positions < {MIN_TOP1[quantize.dtype]:.0%} "
            f"(the {quantize.dtype} floor of a trained model); try --head int8, --block-size 16, --algo hqq, or int8")
    if trained and not exact:
        raise VerificationError(f"{name} vs torch", [line])
    why = "" if trained else " (random weights: reported, not enforced)"
    report.notes.append(line + why)     # the graph is exact (checked above); its quality is the model's and the dtype's
    if log is not None:
        log(f"      note: {line}{why}")


def worst(per_session: dict, name: str | None = None) -> float:
    vals = [v for d in per_session.values() for k, v in d.items() if name is None or k == name]
    return max(vals, default=0.0)


def versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


# --- the driver ----------------------------------------------------------------------------------

def build(checkpoint: Path, out: Path, fuse: bool, dtype: str = "fp32", log=print, quantize=None,
          attention: str = "plain", genai: bool = False, target_why: str = "", source=None,
          kv_cache: str = "fp32") -> BuildReport:
    """Every stage; returns the report (also written to OUT/report.json). `attention`: "plain" ops
    (portable), "fused" (one ONNX Attention op per layer) or "gqa" (ONNX Runtime's GroupQueryAttention,
    graph_passes/ort_attention.py). `quantize`: an export.quantize.QuantConfig (needs fuse and fp32).
    `genai` (needs fuse, fp32, gqa): also the ONNX Runtime GenAI folder's files (export/genai.py).
    `target_why`: why export.build --target auto chose the attention. `source`: the checkpoint's weights
    already opened (models.weights.open_weights), e.g. by the CLI's target choice."""
    from export.verify import ATOL, DEQUANTIZED, SCALE_TOL
    from models.checkpoint import TOKENIZER
    from models.weights import open_weights
    checkpoint, out = Path(checkpoint), Path(out)
    check_output_dir(out, BUILD, inputs=[checkpoint])
    check_options(quantize, genai, fuse, dtype, attention, kv_cache)
    if genai:
        from export.genai import check_tokenizer_files
        check_tokenizer_files(checkpoint)      # the files it would copy for GenAI's tokenizer, before any work
    t_start = time.perf_counter()
    source = source or open_weights(checkpoint)
    cfg = source.cfg
    check_gate(source.skeleton, fuse)
    check_dtype(cfg, dtype)
    estimate = build_memory(cfg, dtype, quantize)
    params = cfg.approx_param_count()
    check_memory(estimate.peak, f"{checkpoint}: the build of {params / 1e9:.2f}B parameters",
                 cheaper_option(cfg, dtype, quantize), share=1.0, needs=estimate.line())
    checked = (DEQUANTIZED if quantize.algo == "rtn" else quantize.dtype) if quantize is not None else \
        verified_as(dtype, kv_cache)
    report = BuildReport(str(checkpoint), str(out), dtype, fuse, attention=attention, atol=ATOL[checked],
                         scale_tol=SCALE_TOL[checked], target=target_of(attention), target_why=target_why,
                         kv_cache=kv_cache)
    gate = source.skeleton.gate.value if cfg.norm == "taper" else None
    report.model = ModelSummary.of(cfg, gate, params)
    report.source, report.notes = source.source, list(source.notes)
    report.memory_estimate = {"peak_bytes": estimate.peak, **estimate.parts}
    name = graph_name(fuse, quantize)
    report.graph = name
    stages = Stages(report, 5 + (1 if genai else 0), log)
    t0 = stages.start(f"open {checkpoint} ({_source_line(source.source)}): weights read as they are written")
    stages.done("open", t0, f": {cfg.norm}{' (' + cfg.taper_scope + ')' if cfg.taper_scope else ''}, {params:,} "
                f"params, {cfg.n_layer} layers, gate {'-' if gate is None else gate}; estimated peak {estimate.line()}")
    for note in source.notes:
        log(f"      note: {note}")
    tokenizer = source.where / TOKENIZER if (source.where / TOKENIZER).is_file() else None
    if tokenizer is None:
        report.notes.append(f"{checkpoint} has no {TOKENIZER}: verified on random tokens only; generation needs one")
    tokens = real_tokens(tokenizer, cfg.vocab_size)
    with output_dir(out, BUILD, inputs=[checkpoint]) as tmp:
        from graph_passes import passes_for
        t0 = stages.start(f"graph {name}: emitted from the model's spec ({dtype}, {attention} attention)"
                          + (f"; fold: {', '.join(passes_for(attention))}" if fuse else "")
                          + (f"; quantize {quantize.dtype} ({quantize.algo}, block {quantize.block_size})" if quantize else ""))
        proto, lazy = make_graph(source, report, fuse, dtype, attention, quantize, kv_cache=kv_cache)
        stages.done("graph", t0, f": {len(proto.graph.node)} nodes, {len(report.folded)} layer(s) folded, "
                    f"{report.norm_ops.get(report_kind(fuse, quantize), 0)} norm op(s) left")
        t0 = stages.start(f"write {name} (each weight read, {'folded, ' if fuse else ''}"
                          f"{'quantized' if quantize else 'cast to ' + dtype} and written, block by block)")
        report.weight_bytes = write_graph(proto, lazy, tmp / name, stages.log, cfg.n_layer)
        if quantize is not None:
            report.quantized["weight_bytes_after"] = report.weight_bytes
        del proto, lazy
        stages.done("write", t0, f": {report.weight_bytes / 1e9:.2f} GB of weights")
        verify_graph(source, tmp / name, report, stages, dtype, quantize, tokens, same_start=attention == "gqa")
        report.eps_approximation = _eps_approximation(source, tmp / name, tokens, attention == "gqa")
        transformers_check(source, report, stages.log, tokens)
        if genai:
            report.genai = genai_files(stages, tmp, name, cfg, checkpoint, tokenizer, tokens)
        write_report(report, tmp, t_start, source, tokenizer)
    summary(report, log)
    return report


def report_kind(fuse: bool, quantize) -> str:
    return quantize.dtype if quantize is not None else ("fused" if fuse else "unfused")


def _source_line(source: str) -> str:
    return f"a Hugging Face {source[3:]} folder, converted as it is read" if source.startswith("hf:") else source


def _eps_approximation(source, path: Path, tokens, same_start: bool) -> dict | None:
    """Disabled norms (eps >= 1e6, LN-free GPT-2): the eps approximation error on the verification tokens
    (models/disabled_norm.py, the model whole: such models are GPT-2 sized); None without any."""
    import copy
    import torch
    from core.contract import contract_of
    from export.conventions import verification_sessions
    from models.checkpoint import DISABLED_NORM_EPS
    from models.disabled_norm import approximation_error
    cfg = source.cfg
    if not any(cfg.eps_of(n) >= DISABLED_NORM_EPS for n in cfg.norm_names()):
        return None
    model = source.fill(copy.deepcopy(source.skeleton), "").eval()
    for rotary in model.rotaries().values():       # non-persistent buffers: to_empty left them unset
        rotary.reset_parameters()
    sessions = verification_sessions(contract_of(path), tokens, same_start=same_start)
    batches = [torch.from_numpy(np.concatenate([s.input_ids for s in steps], axis=1)) for _, steps in sessions]
    approx = approximation_error(model, batches)
    return None if approx is None else {**asdict(approx), "summary": approx.line()}


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


def genai_files(stages: Stages, folder: Path, source: str, cfg, checkpoint: Path, tokenizer, tokens) -> dict:
    """The stage `genai`: the GenAI graph from `source`, its config and tokenizer files, verified against
    `source` (export/genai.py)."""
    from export.genai import GENAI_CONFIG, GENAI_GRAPH, genai_stage
    t0 = stages.start(f"genai: {GENAI_GRAPH} ({source} with ONNX Runtime GenAI's I/O), {GENAI_CONFIG}, "
                      "tokenizer files; verify vs " + source)
    info = genai_stage(folder, source, cfg, checkpoint, tokenizer, tokens)
    for note in info["notes"]:
        stages.log(f"      note: {note}")
    stages.done("genai", t0, f": max |d logits| {info['logits_max_abs_diff']:.3g} (atol {info['atol']:g})"
                + ("" if info["tokenizer"] else "; no tokenizer: GenAI applications feed token ids"))
    return info


# --- the graph stages for a caller that keeps its own files (bench) -------------------------------

def build_graph(source, path: Path, fuse: bool, attention: str = "plain", quantize=None, fold: bool = True,
                verify: bool = True, trained: bool = True, tokens: list[int] | None = None,
                rmsnorm: str = "op") -> BuildReport:
    """One graph of `source` (e.g. models.weights.model_weights(model)) written to `path`: emitted (`rmsnorm`:
    export/emit.py's form of an RMSNorm), folded (fold=False with attention "gqa": ONNX Runtime's rewrites
    alone), quantized, and verified against the torch reference unless verify=False (a quantized graph's
    top-1 floor: a note for trained=False)."""
    from export.verify import ATOL, DEQUANTIZED, SCALE_TOL
    key = (DEQUANTIZED if quantize.algo == "rtn" else quantize.dtype) if quantize is not None else "fp32"
    report = BuildReport("(in memory)", str(path), "fp32", fuse, attention=attention, atol=ATOL[key],
                         scale_tol=SCALE_TOL[key], target=target_of(attention), source=source.source)
    t0 = time.perf_counter()
    proto, lazy = make_graph(source, report, fuse, "fp32", attention, quantize, fold, rmsnorm)
    report.timings_s["graph"] = round(time.perf_counter() - t0, 3)
    report.weight_bytes = write_graph(proto, lazy, Path(path), log=None)
    if verify:
        verify_graph(source, Path(path), report, Stages(report, 0, None), "fp32", quantize, tokens,
                     same_start=attention == "gqa", trained=trained)
    return report


# --- the summary -------------------------------------------------------------------------------------

def by_pass(names) -> str:
    """'taper_scale 8, norm_gamma 1': the sites each graph pass rewrote, in the order the passes ran."""
    return ", ".join(f"{p} {n}" for p, n in Counter(names).items())


def summary(r: BuildReport, log) -> None:
    m = r.model
    src = f", from a Hugging Face {r.source[3:]} folder" if r.source.startswith("hf:") else ""
    log(f"built {r.out} in {r.timings_s['total']:.1f} s: {m.norm}"
        f"{' (' + m.taper_scope + ')' if m.taper_scope else ''}, {r.dtype}{src}"
        f"{'' if r.kv_cache == 'fp32' else f', {r.kv_cache} KV cache'}")
    norm_ops = r.norm_ops
    for kind, counts in r.op_counts.items():
        names = r.norm_layers[kind]
        shown = f" ({', '.join(names)})" if 0 < len(names) <= 3 else ""
        log(f"  {kind:8s} {sum(counts.values())} nodes, {norm_ops[kind]} norm op(s){shown}, "
            f"{counts.get('MatMul', 0) + counts.get('MatMulNBits', 0)} MatMul, {counts.get('Mul', 0)} Mul, "
            f"{counts.get('Add', 0)} Add")
    if r.fuse:
        log(f"  folded   {len(r.folded)} layer(s): " + by_pass(f.pass_name for f in r.folded))
    rewritten = r.quantized.get("rewritten", [])
    if rewritten:
        log(f"  rewrote  {len(rewritten)} site(s) of {r.quantized['file']}: " + by_pass(x["pass"] for x in rewritten))
    for key, per in r.max_abs_diff.items():
        log(f"  {key:17s} max |d logits| {worst(per, 'logits'):.3g}, all outputs {worst(per):.3g} "
            f"(atol {r.atol:g} + {r.scale_tol:g} x max|ref|)")
    if r.transformers_vs_ours:
        log(f"  {transformers_line(r.transformers_vs_ours)}")
    if r.eps_approximation:
        log(f"  eps      {r.eps_approximation['summary']}")
    if r.quantized:
        q, d = r.quantized, r.quantized["drift"]
        log(f"  {q['file']}: {q['matmuls_quantized']} MatMulNBits, {q['gathers_quantized']} GatherBlockQuantized, "
            f"weights {q['weight_bytes_after'] / 1e6:.1f} MB (fp32 {q['weight_bytes_before'] / 1e6:.1f} MB); "
            f"logits max |d| vs the float model {d['logits_max_abs_diff']:.3g}; "
            f"top-1 agreement {d['top1_agreement']:.1%} over {d['top1_positions']} positions")
    if r.genai:
        g = r.genai
        log(f"  genai    {g['graph']} ({g['from']} with GenAI's I/O) + {g['config']}"
            f"{' + ' + ', '.join(g['tokenizer_files']) if g['tokenizer_files'] else ''}: og.Model('{r.out}') loads it; "
            f"logits max |d| vs {g['from']} {g['logits_max_abs_diff']:.3g}")
    log("  " + Target(r.target, r.attention, r.target_why).describe([r.graph]))
    if r.trt_lint and r.target != "ort-cpu":        # an ort-cpu graph is not for TensorRT: the report keeps them
        log(f"  trt_lint {len(r.trt_lint)} issue(s): {r.trt_lint[0]}" + (" ..." if len(r.trt_lint) > 1 else ""))
