"""The build pipeline behind `python -m export.build`, in named stages with a typed report.

    load_checkpoint_stage ─▶ export_stage ─▶ verify_stage(model.onnx vs torch)
        ─▶ [fuse_stage ─▶ verify_stage(model.fused.onnx vs torch and vs model.onnx)
            ─▶ [quantize_stage ─▶ verify_quantized(model.<int8|int4>.onnx vs model.fused.onnx)]] ─▶ write_stage

Each stage takes what the previous ones produced (objects and paths, nothing is
recomputed) and records its time in the BuildReport. The whole build writes into a
temporary sibling of OUT that core.outputs.output_dir swaps into place at the end:
an interrupted or failed build leaves OUT as it was, and OUT is replaced only when
it is an earlier build (it carries the build marker), never when it is or holds the
checkpoint.

The checkpoint may also be a Hugging Face model folder (models/convert.py): it is
converted in memory (the build says so and records it in the report) and the
build's config.json is the converted one. A model without tokenizer.json builds
(verified on random tokens only); generation from the build then needs one.
A model with disabled norms (eps >= 1e6, LN-free GPT-2) gets the eps
approximation error measured on the verification tokens (models/disabled_norm.py).

ModelStages runs the same stages on a model already in memory, one graph at a time, for a
caller that keeps its own files (bench's build cache), with verification optional.
"""
from __future__ import annotations

import copy
import json
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from core.build_files import FUSED, REPORT, UNFUSED
from core.errors import UsageError, UserError
from core.onnx_writer import save_onnx
from core.outputs import BUILD, MARKER, check_output_dir, output_dir, sign_onnx
from export.target import Target, target_of

NORM_OPS = ("RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization")
REAL_TEXT = ("Once upon a time there was a little girl named Lily. She loved to play in the garden "
             "with her red ball, and one day she saw a big dog under the tall tree.")


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
    files: list[str] = field(default_factory=list)
    op_counts: dict[str, dict[str, int]] = field(default_factory=dict)      # unfused / fused -> op -> count
    norm_layers: dict[str, list[str]] = field(default_factory=dict)         # layers whose norm op remains
    folded: list[Fold] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    trt_lint: list[str] = field(default_factory=list)
    atol: float = 0.0
    scale_tol: float = 0.0
    max_abs_diff: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # pair -> session -> output
    timings_s: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    source: str = "checkpoint"           # checkpoint | hf:<model_type> (converted in memory)
    eps_approximation: dict | None = None  # disabled norms: models.disabled_norm.EpsApproximation
    quantized: dict = field(default_factory=dict)      # --quantize: what was quantized, tolerance, drift
    route: str = "in-memory"             # in-memory (this module) | streamed (export/streamed.py)
    memory_estimate: dict | None = None  # streamed: the estimated peak and its parts, bytes
    genai: dict = field(default_factory=dict)      # --genai: the GenAI graph, its config, tokenizer files, check
    target: str = ""                     # ort-cpu | portable: the runtime the graphs are for (export/target.py)
    target_why: str = ""                 # why --target auto chose it

    @property
    def norm_ops(self) -> dict[str, int]:
        return {k: sum(v.get(op, 0) for op in NORM_OPS) for k, v in self.op_counts.items()}

    def to_json(self) -> dict:
        d = asdict(self)
        d["folded"] = [{"pass": f.pass_name, "layer": f.layer, "detail": f.detail} for f in self.folded]
        d["norm_ops"] = self.norm_ops
        return d


@dataclass
class Loaded:
    model: object                # models.decoder.Decoder, fp32
    reference: object            # the torch reference in the build dtype
    tokens: list[int] | None     # real text, tokenized (None: no tokenizer, or it yields nothing usable)
    tokenizer: Path | None = None   # the tokenizer.json the build copies (None: the model has none)
    source: str = "checkpoint"      # checkpoint | hf:<model_type>
    notes: list[str] = field(default_factory=list)


class Stages:
    """Progress lines `[i/n] what` and per-stage timings, in the report."""

    def __init__(self, report: BuildReport, n: int, log):
        self.report, self.n, self.log, self.i = report, n, log, 0

    def start(self, msg: str) -> float:
        self.i += 1
        self.log(f"[{self.i}/{self.n}] {msg}")
        return time.perf_counter()

    def done(self, key: str, t0: float, extra: str = "") -> None:
        self.report.timings_s[key] = round(time.perf_counter() - t0, 3)
        self.log(f"      {self.report.timings_s[key]:.1f} s{extra}")


# --- stages ------------------------------------------------------------------------------------

def check_gate(model, fuse: bool) -> None:
    """--fuse folds a TaperNorm only at gate 0: refuse a model (or a weights source's skeleton) before any work."""
    if fuse and model.cfg.norm == "taper" and model.gate.value != 0.0:
        raise BuildError(f"{', '.join(model.taper_layers())}: TaperNorm gate {model.gate.value:g}; --fuse needs gate 0 "
                         "(finish the taper, or build without --fuse)")


FP16_MAX = float(np.finfo(np.float16).max)      # 65504: a larger finite weight is inf once cast to fp16


def check_fp16_range(name: str, low: float, high: float) -> None:
    """Refuse (one line naming the tensor) a weight whose extremes `low`, `high` (of its fp32 values, before
    the cast) fp16 cannot hold: it would turn inf in the graph and NaN in the logits, in the torch
    reference (cast the same way) too, so the verification would not see it."""
    worst = max(abs(float(low)), abs(float(high)))
    if not worst <= FP16_MAX:
        raise BuildError(f"{name}: expected weights within fp16's range (|w| <= {FP16_MAX:g}) for --dtype fp16, found "
                         f"max |w| {worst:.6g}; build with --dtype fp32 or --dtype bf16")


def check_model(model, fuse: bool, dtype: str) -> None:
    """Refuse, before anything is written, what the build cannot do."""
    import torch
    from models.checkpoint import DISABLED_NORM_EPS
    check_gate(model, fuse)
    if dtype == "fp16":
        for name, t in model.state_dict().items():
            if t.is_floating_point() and t.numel():
                check_fp16_range(name, *torch.aminmax(t.detach()))
        eps = {name or "model": m.eps for name, m in model.named_modules()
               if isinstance(getattr(m, "eps", None), (int, float)) and m.eps >= DISABLED_NORM_EPS}
        if eps:
            raise BuildError(f"{', '.join(eps)}: norm eps {max(eps.values()):g} >= {DISABLED_NORM_EPS:g} is a disabled "
                             f"(FakeLN-style) norm and overflows fp16 (max 65504); build with --dtype fp32")


def real_tokens(tokenizer: Path | None, vocab_size: int) -> list[int] | None:
    """REAL_TEXT by the model's tokenizer.json, ids inside the vocabulary (None: no tokenizer, or
    nothing usable): the verification's real-text session and a quantized graph's greedy prompt."""
    if tokenizer is None:
        return None
    from models.checkpoint import load_tokenizer
    return [i for i in load_tokenizer(Path(tokenizer).parent).encode(REAL_TEXT).ids if i < vocab_size] or None


def load_checkpoint_stage(checkpoint: Path, fuse: bool, dtype: str) -> Loaded:
    """Our checkpoint, or a Hugging Face folder converted in memory."""
    from models.checkpoint import TOKENIZER, has_tokenizer, load_checkpoint
    from models.convert import convert, is_hf_folder
    from models.decoder import TORCH_DTYPES
    if is_hf_folder(checkpoint):
        c = convert(checkpoint)
        model, tokenizer, source, notes = c.model, c.tokenizer, f"hf:{c.model_type}", c.notes
    else:
        model, source, notes = load_checkpoint(checkpoint), "checkpoint", []
        tokenizer = None if has_tokenizer(checkpoint) is False else checkpoint / TOKENIZER
        if tokenizer is None:
            notes.append(f"{checkpoint} has no {TOKENIZER}: verified on random tokens only; generation needs one")
    check_model(model, fuse, dtype)
    reference = model if dtype == "fp32" else copy.deepcopy(model).to(TORCH_DTYPES[dtype])
    return Loaded(model, reference, real_tokens(tokenizer, model.cfg.vocab_size), tokenizer, source, notes)


def eps_stage(loaded: Loaded, verifier: "Verifier") -> dict | None:
    """The eps approximation error of disabled norms, on the verification tokens (None without any)."""
    import torch
    from models.disabled_norm import approximation_error
    batches = [torch.from_numpy(np.concatenate([s.input_ids for s in steps], axis=1)) for _, steps in verifier.sessions]
    approx = approximation_error(loaded.model, batches)
    return None if approx is None else {**asdict(approx), "summary": approx.line()}


def export_stage(loaded: Loaded, path: Path, dtype: str, attention: str = "plain"):
    from export.onnx_export import export_onnx
    return export_onnx(loaded.model, path, dtype, attention=attention)


class Verifier:
    """The decode sessions of a build, with the torch reference and each graph's outputs computed once."""

    def __init__(self, loaded: Loaded, proto, seeds=(0, 1), same_start: bool = False):
        from export.conventions import verification_sessions
        from export.verify import read_interface, rounding_slack, run_torch
        self.iface = read_interface(proto)
        # same_start: batched prefills at slot 0, what a GroupQueryAttention graph takes (--attention gqa)
        self.sessions = verification_sessions(self.iface, loaded.tokens, seeds, same_start)
        self.torch = [run_torch(loaded.reference, self.iface, steps) for _, steps in self.sessions]
        # against torch, an fp32 graph may round as far as torch's own fp32 does (export.verify.rounding_slack)
        self.slacks = [rounding_slack(loaded.reference, self.iface, steps, ref)
                       for (_, steps), ref in zip(self.sessions, self.torch)] if self.iface.dtype == "fp32" else None
        self.runs: dict[str, list] = {}            # graph kind -> its runs (runs_of)

    def run(self, proto) -> list:
        from export.verify import ort_session, run_onnx
        sess = ort_session(proto)
        return [run_onnx(sess, self.iface, steps) for _, steps in self.sessions]

    def runs_of(self, kind: str, proto) -> list:
        """run(proto) once per graph kind (unfused, fused, unfused_ort), kept for the stages after it."""
        if kind not in self.runs:
            self.runs[kind] = self.run(proto)
        return self.runs[kind]

    def compare(self, ref_runs, runs, what: str, tolerance: str | None = None) -> dict:
        """session label -> output -> max abs diff; raises VerificationError on any mismatch.
        `tolerance`: the export.verify ATOL / SCALE_TOL entry (default: the graph's dtype)."""
        from export.verify import compare_sessions
        slacks = self.slacks if ref_runs is self.torch or self.slacks is None else \
            [{k: 2 * v for k, v in s.items()} for s in self.slacks]     # two graphs: each rounds on its own
        results = compare_sessions(self.sessions, ref_runs, runs, tolerance or self.iface.dtype, what, slacks=slacks)
        return {c.what: c.max_abs_diff for c in results}

    def check_against_export(self, report: BuildReport, unfused, graph, kind: str, name: str) -> None:
        """`graph` (a `kind` graph, `name` in messages) against torch and against the export `unfused`, interfaces
        first, into report.max_abs_diff[<kind>_vs_torch / <kind>_vs_unfused]; the runs of both kept (runs_of)."""
        from export.verify import VerificationError, interface_mismatches, read_interface
        unfused_runs = self.runs_of("unfused", unfused)
        bad = interface_mismatches(read_interface(unfused), read_interface(graph))
        if bad:
            raise VerificationError(f"{name} vs model.onnx interfaces", bad)
        runs = self.runs_of(kind, graph)
        report.max_abs_diff[f"{kind}_vs_torch"] = self.compare(self.torch, runs, f"{name} vs torch")
        report.max_abs_diff[f"{kind}_vs_unfused"] = self.compare(unfused_runs, runs, f"{name} vs model.onnx")


def fuse_stage(proto, report: BuildReport, attention: str = "plain", fold: bool = True):
    """Run the default passes (and with attention "gqa" the ONNX Runtime rewrite); every TaperNorm
    must fold and every layer's attention must become GroupQueryAttention (a leftover is an
    error, with the reasons). fold=False: the ONNX Runtime rewrites alone, norms left as exported
    (with attention "gqa": an unfolded graph on the same attention kernel, bench's unfused variants)."""
    from graph_passes import passes_for, run_passes
    from graph_passes.registry import ORT_PASSES
    fused, results = run_passes(proto, passes_for(attention) if fold else ORT_PASSES)
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


def quantize_stage(fused, cfg, path: Path, report: BuildReport):
    """Quantize the folded fp32 graph's weights (export/quantize.py) and write it to `path`."""
    from export.quantize import quantize_weights
    quantized, summary = quantize_weights(fused, cfg)
    save_onnx(sign_onnx(quantized), path)
    report.quantized = {"file": path.name, **asdict(summary)}
    _graph_stats(report, cfg.dtype, quantized)
    return quantized


def quantized_drift(float_runs, runs, agree: float, n: int, prompt: str) -> dict:
    """report.quantized["drift"] of both routes: the quantized graph's logits against the float model's,
    and the top-1 agreement (`agree` over `n` positions of `prompt`)."""
    from export.quantize import logits_diff
    worst_logits, mean_logits, ref_scale = logits_diff(float_runs, runs)
    return {"logits_max_abs_diff": worst_logits, "logits_mean_abs_diff": mean_logits, "logits_max_abs_fused": ref_scale,
            "top1_agreement": agree, "top1_positions": n, "top1_prompt": prompt}


def verify_quantized(verifier: "Verifier", loaded: Loaded, fused, quantized, cfg, report: BuildReport,
                     trained: bool = True) -> None:
    """The quantized graph against the fp32 fused graph: every output within the dtype's
    tolerance (export.verify), logits drift, and top-1 agreement over a greedy run on real text;
    an agreement below MIN_TOP1[dtype] fails the build of a trained model. `trained=False` (random
    weights, the bench's larger sizes): the floor, a trained model's, is reported in a note instead
    (random-init int4 agrees on ~20 % of tokens whatever the graph; the tolerance still holds)."""
    from export.quantize import GREEDY_TOKENS, MIN_TOP1, fit_prompt, top1_agreement
    from export.verify import ATOL, SCALE_TOL, VerificationError, ort_session
    fused_runs = verifier.runs_of("fused", fused)
    runs = verifier.run(quantized)
    key = f"{cfg.dtype}_vs_fused"
    report.max_abs_diff[key] = verifier.compare(fused_runs, runs, f"{cfg.file_name()} vs {FUSED}", cfg.dtype)
    text = "real text" if loaded.tokens else "random tokens"
    prompt = loaded.tokens or [int(t) for t in np.random.default_rng(0).integers(0, verifier.iface.vocab_size, 16)]
    prompt = fit_prompt(prompt, verifier.iface, GREEDY_TOKENS)
    agree, n = top1_agreement(ort_session(fused), ort_session(quantized), verifier.iface, prompt, GREEDY_TOKENS)
    report.quantized["tolerance"] = {"atol": ATOL[cfg.dtype], "scale_tol": SCALE_TOL[cfg.dtype],
                                     "min_top1": MIN_TOP1[cfg.dtype]}
    report.quantized["drift"] = quantized_drift(fused_runs, runs, agree, n, f"{text}, {len(prompt)} tokens")
    if agree < MIN_TOP1[cfg.dtype]:
        line = (f"top-1 agreement {agree:.3f} over {n} greedy tokens < {MIN_TOP1[cfg.dtype]} (the {cfg.dtype} floor); "
                "try --head int8, --block-size 16, --algo hqq, or int8")
        if trained:
            raise VerificationError(f"{cfg.file_name()} vs {FUSED}", [line])
        report.notes.append(f"{line} (random weights: reported, not enforced)")


def _leftover_taper(proto) -> list[str]:
    """TaperNorm nodes still in a fused graph (by torch provenance)."""
    from graph_passes.base import PassContext
    ctx = PassContext(proto)
    return sorted({ctx.layer_name(n) for n in ctx.graph.nodes
                   if any(c.endswith(".TaperNorm") for c in ctx.module_class(n))})


def _graph_stats(report: BuildReport, kind: str, proto) -> None:
    """The graph's op counts and the layers of the normalization ops left in it."""
    from graph_passes.base import PassContext, op_counts
    report.op_counts[kind] = op_counts(proto)
    ctx = PassContext(proto)
    report.norm_layers[kind] = [ctx.layer_name(n) for n in ctx.graph.nodes if n.op in NORM_OPS]


def worst(per_session: dict, name: str | None = None) -> float:
    vals = [v for d in per_session.values() for k, v in d.items() if name is None or k == name]
    return max(vals, default=0.0)


def versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


# --- the stages on a model in memory ----------------------------------------------------------------

@dataclass
class StageGraph:
    """One graph ModelStages built, with a BuildReport of its own holding what build() records of
    it: op_counts[kind], max_abs_diff (pair -> session -> output; empty when not verified), the
    folds and notes of a fuse, the quantization summary, tolerance and drift of a quantized graph."""
    proto: object
    kind: str                   # unfused | fused | unfused_ort | int8 | int4
    report: BuildReport


class ModelStages:
    """build()'s stages over a model already in memory, one graph at a time, for a caller that
    keeps its own files (bench's build cache): export, fuse, quantize, each verified as build()
    verifies it (the torch reference, the dtype's tolerance, a quantized graph's top-1 floor:
    a note for random weights, trained=False) unless verify=False. The torch reference runs
    once, on first use, on build()'s sessions (random tokens, and REAL_TEXT when a tokenizer
    is given); each graph's runs are kept."""

    def __init__(self, model, tokenizer: Path | None = None, attention: str = "plain", verify: bool = True,
                 trained: bool = True):
        self.loaded = Loaded(model, model, real_tokens(tokenizer, model.cfg.vocab_size), tokenizer)
        self.attention, self.verify, self.trained = attention, verify, trained
        self._verifier: Verifier | None = None

    def export(self) -> StageGraph:
        """model.onnx's stage (with attention "gqa" the portable Attention op, as build()), verified against torch."""
        report = self._report()
        proto = export_stage(self.loaded, None, "fp32", "fused" if self.attention == "gqa" else self.attention)
        _graph_stats(report, "unfused", proto)
        if self.verify:
            v = self._verifier_for(proto)
            report.max_abs_diff["unfused_vs_torch"] = v.compare(v.torch, v.runs_of("unfused", proto),
                                                                "model.onnx vs torch")
        return StageGraph(proto, "unfused", report)

    def fuse(self, unfused, fold: bool = True) -> StageGraph:
        """model.fused.onnx's stage on the export `unfused` (fold=False: the ONNX Runtime rewrites
        alone, fuse_stage), verified against torch and against the export, interfaces first."""
        report, kind = self._report(), "fused" if fold else "unfused_ort"
        proto = fuse_stage(unfused, report, self.attention, fold)
        _graph_stats(report, kind, proto)
        if self.verify:
            self._verifier_for(unfused).check_against_export(report, unfused, proto, kind, f"{kind} graph")
        return StageGraph(proto, kind, report)

    def quantize(self, fused, cfg, path: Path) -> StageGraph:
        """model.<int8|int4>.onnx's stage on the fused fp32 graph, written to `path` (quantize_stage),
        verified against the fused graph (verify_quantized: tolerance, drift, top-1 floor)."""
        report = self._report()
        proto = quantize_stage(fused, cfg, path, report)
        if self.verify:
            verify_quantized(self._verifier_for(fused), self.loaded, fused, proto, cfg, report, self.trained)
        return StageGraph(proto, cfg.dtype, report)

    def _report(self) -> BuildReport:
        from export.verify import ATOL, SCALE_TOL
        return BuildReport(checkpoint="(in memory)", out="", dtype="fp32", fuse=True, attention=self.attention,
                           atol=ATOL["fp32"], scale_tol=SCALE_TOL["fp32"])

    def _verifier_for(self, proto) -> Verifier:
        """The sessions and torch reference, built from the first graph verified (all share one interface)."""
        if self._verifier is None:
            # same_start: batched prefills at slot 0, what a GroupQueryAttention graph takes
            self._verifier = Verifier(self.loaded, proto, same_start=self.attention == "gqa")
        return self._verifier


# --- the driver ----------------------------------------------------------------------------------

def build(checkpoint: Path, out: Path, fuse: bool, dtype: str = "fp32", log=print, quantize=None,
          attention: str = "plain", genai: bool = False, target_why: str = "") -> BuildReport:
    """Run every stage; returns the report (also written to OUT/report.json).
    `attention`: "plain" ops (portable), "fused" (one ONNX Attention op per layer) or "gqa" (model.fused.onnx
    rewritten to ONNX Runtime's GroupQueryAttention, graph_passes/ort_attention.py).
    `quantize`: an export.quantize.QuantConfig (needs fuse and fp32): also model.<int8|int4>.onnx.
    `genai` (needs fuse, fp32, gqa): also the ONNX Runtime GenAI folder's files (export/genai.py).
    `target_why`: why export.build --target auto chose the attention, for the report (export/target.py)."""
    from export.verify import ATOL, SCALE_TOL
    checkpoint, out = Path(checkpoint), Path(out)
    check_output_dir(out, BUILD, inputs=[checkpoint])
    check_options(quantize, genai, fuse, dtype, attention)
    if genai:
        from export.genai import check_tokenizer_files
        check_tokenizer_files(Path(checkpoint))      # the files it would copy for GenAI's tokenizer, before any work
    t_start = time.perf_counter()
    report = BuildReport(str(checkpoint), str(out), dtype, fuse, atol=ATOL[dtype], scale_tol=SCALE_TOL[dtype],
                         attention=attention, target=target_of(attention), target_why=target_why)
    stages = Stages(report, (6 if fuse else 4) + (2 if quantize else 0) + (1 if genai else 0), log)
    loaded = _load_stage(stages, report, checkpoint, fuse, dtype)

    with output_dir(out, BUILD, inputs=[checkpoint]) as tmp:
        t0 = stages.start(f"export {dtype} ONNX (opset 24, KV cache via TensorScatter, {attention} attention)")
        # gqa: model.onnx keeps the portable Attention op; the fuse stage rewrites model.fused.onnx
        proto = export_stage(loaded, tmp / UNFUSED, dtype, "fused" if attention == "gqa" else attention)
        _graph_stats(report, "unfused", proto)
        stages.done("export", t0, f": {len(proto.graph.node)} nodes")

        t0 = stages.start("verify model.onnx vs torch (prefill + 3 decode steps, random and real tokens)")
        verifier = Verifier(loaded, proto, same_start=attention == "gqa")
        report.max_abs_diff["unfused_vs_torch"] = verifier.compare(verifier.torch, verifier.runs_of("unfused", proto),
                                                                   "model.onnx vs torch")
        report.eps_approximation = eps_stage(loaded, verifier)
        stages.done("verify_unfused", t0, f": max |d logits| {worst(report.max_abs_diff['unfused_vs_torch'], 'logits'):.3g}"
                    + (f"\n      eps approximation: {report.eps_approximation['summary']}" if report.eps_approximation else ""))

        if fuse:
            fused = _fuse_stages(stages, report, verifier, proto, tmp / FUSED, attention)
            if quantize is not None:
                _quantize_stages(stages, report, verifier, loaded, fused, quantize, tmp)
            if genai:
                report.genai = genai_files(stages, tmp, quantize.file_name() if quantize else FUSED, loaded.model.cfg,
                                           checkpoint, loaded.tokenizer, loaded.tokens)

        t0 = stages.start(f"write {out}")
        write_report(report, tmp, t_start, checkpoint, loaded.source, loaded.model, loaded.tokenizer)
    stages.done("write", t0)
    summary(report, log)
    return report


def _load_stage(stages: Stages, report: BuildReport, checkpoint: Path, fuse: bool, dtype: str) -> Loaded:
    """load_checkpoint_stage, announced once loaded and checked (a refusal prints only its error line)."""
    t0 = time.perf_counter()
    loaded = load_checkpoint_stage(checkpoint, fuse, dtype)
    cfg, model = loaded.model.cfg, loaded.model
    gate = model.gate.value if cfg.norm == "taper" else None
    report.model = ModelSummary.of(cfg, gate, model.num_params())
    report.source = loaded.source
    report.notes += loaded.notes
    if loaded.source == "checkpoint":
        stages.start(f"load checkpoint {checkpoint}")
    else:
        stages.start(f"convert Hugging Face {loaded.source[3:]} folder {checkpoint} in memory "
                     f"(python -m models.convert saves it as a checkpoint)")
    stages.done("load", t0, f": {cfg.norm}{' (' + cfg.taper_scope + ')' if cfg.taper_scope else ''}, "
                f"{model.num_params():,} params, gate {'-' if gate is None else gate}")
    for note in loaded.notes[1 if loaded.source != "checkpoint" else 0:]:
        stages.log(f"      note: {note}")
    return loaded


def _fuse_stages(stages: Stages, report: BuildReport, verifier: Verifier, proto, path: Path, attention: str):
    """fuse_stage, written to `path`, then verified against torch and model.onnx (interfaces first);
    returns the fused graph."""
    from graph_passes import passes_for
    t0 = stages.start(f"fuse: {', '.join(passes_for(attention))}")
    fused = fuse_stage(proto, report, attention)
    save_onnx(sign_onnx(fused), path)
    _graph_stats(report, "fused", fused)
    stages.done("fuse", t0, f": {len(report.folded)} layer(s) folded, nodes {len(proto.graph.node)} -> "
                f"{len(fused.graph.node)}")

    t0 = stages.start("verify model.fused.onnx vs torch and vs model.onnx")
    verifier.check_against_export(report, proto, fused, "fused", FUSED)
    stages.done("verify_fused", t0, f": max |d logits| vs torch "
                f"{worst(report.max_abs_diff['fused_vs_torch'], 'logits'):.3g}")
    return fused


def _quantize_stages(stages: Stages, report: BuildReport, verifier: Verifier, loaded: Loaded, fused, q,
                     folder: Path) -> None:
    """quantize_stage into `folder`, then verify_quantized against the fused graph."""
    t0 = stages.start(f"quantize {q.dtype} weights ({q.algo}, block {q.block_size}, accuracy level "
                      f"{q.accuracy_level}): {FUSED} -> {q.file_name()}")
    quantized = quantize_stage(fused, q, folder / q.file_name(), report)
    stages.done("quantize", t0, f": {report.quantized['matmuls_quantized']} MatMul(s), "
                f"{report.quantized['gathers_quantized']} Gather(s); weights "
                f"{report.quantized['weight_bytes_before'] / 1e6:.1f} -> "
                f"{report.quantized['weight_bytes_after'] / 1e6:.1f} MB; embedding / head table "
                f"{report.quantized['tied_table'].split(':')[0]}; rewrote "
                f"{by_pass(x['pass'] for x in report.quantized['rewritten']) or 'nothing'}")
    t0 = stages.start(f"verify {q.file_name()} vs {FUSED} (tolerance per dtype; top-1 over greedy tokens)")
    verify_quantized(verifier, loaded, fused, quantized, q, report)
    d = report.quantized["drift"]
    stages.done("verify_quantized", t0, f": max |d logits| {d['logits_max_abs_diff']:.3g}, top-1 "
                f"{d['top1_agreement']:.1%} over {d['top1_positions']} tokens")


def write_report(report: BuildReport, folder: Path, t_start: float, checkpoint: Path, source: str, model,
                 tokenizer: Path | None) -> None:
    """Both routes' last step: config.json (the checkpoint's own; a converted model's, what was built) and
    tokenizer.json, then versions, the total time, the file list and report.json itself."""
    from models.checkpoint import CONFIG, TOKENIZER, checkpoint_config
    if source == "checkpoint":
        shutil.copyfile(checkpoint / CONFIG, folder / CONFIG)
    else:
        (folder / CONFIG).write_text(json.dumps(checkpoint_config(model, tokenizer is not None), indent=2) + "\n")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, folder / TOKENIZER)
    report.versions = versions()
    report.timings_s["total"] = round(time.perf_counter() - t_start, 3)
    report.files = sorted(p.name for p in folder.iterdir() if p.name != MARKER) + [REPORT]   # (the build's files)
    (folder / REPORT).write_text(json.dumps(report.to_json(), indent=2) + "\n")


def genai_files(stages: Stages, folder: Path, source: str, cfg, checkpoint: Path, tokenizer, tokens) -> dict:
    """The stage `genai` of both routes: the GenAI graph from `source`, its config and tokenizer files,
    verified against `source` (export/genai.py)."""
    from export.genai import GENAI_CONFIG, GENAI_GRAPH, genai_stage
    t0 = stages.start(f"genai: {GENAI_GRAPH} ({source} with ONNX Runtime GenAI's I/O), {GENAI_CONFIG}, "
                      "tokenizer files; verify vs " + source)
    info = genai_stage(folder, source, cfg, checkpoint, tokenizer, tokens)
    for note in info["notes"]:
        stages.log(f"      note: {note}")
    stages.done("genai", t0, f": max |d logits| {info['logits_max_abs_diff']:.3g} (atol {info['atol']:g})"
                + ("" if info["tokenizer"] else "; no tokenizer: GenAI applications feed token ids"))
    return info


def check_options(quantize, genai: bool, fuse: bool, dtype: str, attention: str) -> None:
    """Every combination of build options refused before any work, in this order (each names its option)."""
    from export.genai import check_genai
    check_quantize(quantize, fuse, dtype)
    check_genai(genai, fuse, dtype, attention)      # before check_attention: it names the option the user gave
    check_attention(attention, fuse, dtype)


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


def by_pass(names) -> str:
    """'taper_scale 8, norm_gamma 1': the sites each graph pass rewrote, in the order the passes ran."""
    return ", ".join(f"{p} {n}" for p, n in Counter(names).items())


def summary(r: BuildReport, log) -> None:
    m = r.model
    src = f", from a Hugging Face {r.source[3:]} folder" if r.source.startswith("hf:") else ""
    log(f"built {r.out} in {r.timings_s['total']:.1f} s: {m.norm}"
        f"{' (' + m.taper_scope + ')' if m.taper_scope else ''}, {r.dtype}{src}")
    norm_ops = r.norm_ops
    for kind, counts in r.op_counts.items():
        names = r.norm_layers[kind]
        shown = f" ({', '.join(names)})" if 0 < len(names) <= 3 else ""
        log(f"  {kind:8s} {sum(counts.values())} nodes, {norm_ops[kind]} norm op(s){shown}, "
            f"{counts.get('MatMul', 0)} MatMul, {counts.get('Mul', 0)} Mul, {counts.get('Add', 0)} Add")
    if r.fuse:
        log(f"  folded   {len(r.folded)} layer(s): " + by_pass(f.pass_name for f in r.folded))
    rewritten = r.quantized.get("rewritten", [])
    if rewritten:
        log(f"  rewrote  {len(rewritten)} site(s) of {r.quantized['file']}: " + by_pass(x["pass"] for x in rewritten))
    for key, per in r.max_abs_diff.items():
        tol = f"atol {r.atol:g}" + (f" + {r.scale_tol:g} x max|ref|" if r.scale_tol else "")
        if r.quantized and key.endswith("_vs_fused"):
            t = r.quantized["tolerance"]
            tol = f"atol {t['atol']:g} + {t['scale_tol']:g} x max|ref|"
        log(f"  {key:17s} max |d logits| {worst(per, 'logits'):.3g}, all outputs {worst(per):.3g} ({tol})")
    if r.eps_approximation:
        log(f"  eps      {r.eps_approximation['summary']}")
    if r.quantized:
        q, d = r.quantized, r.quantized["drift"]
        log(f"  {q['file']}: {q['matmuls_quantized']} MatMulNBits, {q['gathers_quantized']} GatherBlockQuantized, "
            f"weights {q['weight_bytes_after'] / 1e6:.1f} MB (fp32 {q['weight_bytes_before'] / 1e6:.1f} MB); "
            f"logits max |d| {d['logits_max_abs_diff']:.3g}, mean {d['logits_mean_abs_diff']:.3g}; "
            f"top-1 agreement {d['top1_agreement']:.1%} over {d['top1_positions']} greedy tokens")
    if r.genai:
        g = r.genai
        log(f"  genai    {g['graph']} ({g['from']} with GenAI's I/O) + {g['config']}"
            f"{' + ' + ', '.join(g['tokenizer_files']) if g['tokenizer_files'] else ''}: og.Model('{r.out}') loads it; "
            f"logits max |d| vs {g['from']} {g['logits_max_abs_diff']:.3g}")
    graphs = [f for f in r.files if f.endswith(".onnx") and not f.endswith(".genai.onnx")
              and (r.target != "ort-cpu" or f != UNFUSED)]       # a gqa build's model.onnx is its portable export
    log("  " + Target(r.target, r.attention, r.target_why).describe(graphs))
    if r.trt_lint and r.target != "ort-cpu":        # an ort-cpu graph is not for TensorRT: the report keeps them
        log(f"  trt_lint {len(r.trt_lint)} issue(s): {r.trt_lint[0]}" + (" ..." if len(r.trt_lint) > 1 else ""))
