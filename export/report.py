"""What one build did, in typed parts: the BuildReport (written as OUT/report.json, layout in docs/export.md),
the progress lines and timings of its stages, and the summary it prints.

    BuildReport ── model: ModelSummary           the checkpoint's shape
                ├─ folded: [Fold]                what each graph pass folded
                ├─ verification: Verification    the written graph vs the torch reference, and its tolerance
                ├─ quantized: QuantizedPart      --quantize: what was quantized, the drift, the tolerance
                ├─ genai: export.genai.GenAIFolder                 --genai: GenAI's folder and its check
                ├─ transformers_vs_ours: export.transformers_check.TransformersCheck   a Hugging Face folder
                ├─ memory_estimate: export.memory.MemoryEstimate
                └─ eps_approximation: models.disabled_norm.EpsApproximation        disabled norms

Python reads the parts as fields; `to_json` writes report.json with the keys it always had (a part that is
absent is `{}` or null there, as before), so that users' scripts keep working.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from export.genai import GenAIFolder
    from export.memory import MemoryEstimate
    from export.quantize import QuantSummary
    from export.transformers_check import TransformersCheck
    from models.disabled_norm import EpsApproximation

NORM_OPS = ("RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization")
GRAPH_VS_TORCH = "graph_vs_torch"       # report.json's key of the verification's diffs


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
class Verification:
    """The written graph against the torch reference (export/reference_check.py): the tolerance it was held to
    (export/verify.py: atol + scale_tol x max |reference|) and, per session and output, the max |diff|
    (empty: not verified)."""
    atol: float = 0.0
    scale_tol: float = 0.0
    graph_vs_torch: dict[str, dict[str, float]] = field(default_factory=dict)

    def worst(self, output: str | None = None) -> float:
        """The largest diff of `output` (None: of every output) over the sessions."""
        return worst(self.graph_vs_torch, output)


@dataclass
class QuantDrift:
    """A quantized graph against the float model (not a check of the graph: what the quantization costs):
    its logits' drift on the verification sessions, and the share of positions where both models' argmax
    agree, teacher-forced (both read the same tokens) over `top1_prompt`. bench.quant_quality measures the
    other top-1: greedy generation (core.decode.greedy_top1_agreement)."""
    logits_max_abs_diff: float
    logits_mean_abs_diff: float
    logits_max_abs_fused: float      # max |float model's logits|: the scale of the diffs
    teacher_forced_top1: float
    top1_positions: int
    top1_prompt: str

    def to_json(self) -> dict:
        return {"logits_max_abs_diff": self.logits_max_abs_diff, "logits_mean_abs_diff": self.logits_mean_abs_diff,
                "logits_max_abs_fused": self.logits_max_abs_fused, "top1_agreement": self.teacher_forced_top1,
                "top1_positions": self.top1_positions, "top1_prompt": self.top1_prompt}


@dataclass
class QuantTolerance:
    """What a quantized graph was held to: its verification's tolerance, against its own dequantized weights
    (rtn) or the float model, and the teacher-forced top-1 floor (export.quantize.MIN_TOP1)."""
    atol: float
    scale_tol: float
    min_top1: float
    checked_against: str                  # "dequantized weights" | "float model"


@dataclass
class QuantizedPart:
    """--quantize: the graph file, what export.quantize did (QuantSummary), and once verified the drift
    against the float model and the tolerance."""
    file: str
    summary: QuantSummary
    drift: QuantDrift | None = None
    tolerance: QuantTolerance | None = None

    def to_json(self) -> dict:
        out = {"file": self.file, **asdict(self.summary)}
        if self.drift is not None:
            out["drift"] = self.drift.to_json()
        if self.tolerance is not None:
            out["tolerance"] = asdict(self.tolerance)
        return out


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
    verification: Verification = field(default_factory=Verification)
    timings_s: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    source: str = "checkpoint"           # checkpoint | hf:<model_type> (converted as read) | in-memory
    eps_approximation: EpsApproximation | None = None      # disabled norms: the approximation's error
    quantized: QuantizedPart | None = None                 # --quantize
    memory_estimate: MemoryEstimate | None = None          # the estimated peak and its parts, bytes
    weight_bytes: int = 0                # bytes of weights written
    genai: GenAIFolder | None = None                       # --genai: the GenAI graph, its config, files, check
    target: str = ""                     # ort-cpu | portable: the runtime the graphs are for (export/target.py)
    target_why: str = ""                 # why --target auto chose it
    kv_cache: str = "fp32"               # the KV caches' dtype (--kv-cache; fp16, int8: GroupQueryAttention graphs)
    kv_cache_why: str = ""               # why --kv-cache auto chose it ("" when the option named the dtype)
    kv_cache_check: object | None = None    # --kv-cache int8: export.kv_int8.Int8Cache (calibration and drift)
    # a Hugging Face folder: our torch model (the reference above) against transformers' own forward, or why
    # it was skipped (export/transformers_check.py)
    transformers_vs_ours: TransformersCheck | None = None

    @property
    def norm_ops(self) -> dict[str, int]:
        return {k: sum(v.get(op, 0) for op in NORM_OPS) for k, v in self.op_counts.items()}

    def to_json(self) -> dict:
        """report.json: the keys and layout it always had (docs/export.md)."""
        v, eps = self.verification, self.eps_approximation
        return {
            "checkpoint": self.checkpoint, "out": self.out, "dtype": self.dtype, "fuse": self.fuse,
            "attention": self.attention, "model": None if self.model is None else asdict(self.model),
            "graph": self.graph, "files": list(self.files), "op_counts": self.op_counts,
            "norm_layers": self.norm_layers,
            "folded": [{"pass": f.pass_name, "layer": f.layer, "detail": f.detail} for f in self.folded],
            "notes": list(self.notes), "trt_lint": list(self.trt_lint),
            "atol": v.atol, "scale_tol": v.scale_tol,
            "max_abs_diff": {GRAPH_VS_TORCH: v.graph_vs_torch} if v.graph_vs_torch else {},
            "timings_s": self.timings_s, "versions": self.versions, "source": self.source,
            "eps_approximation": None if eps is None else {**asdict(eps), "summary": eps.line()},
            "quantized": {} if self.quantized is None else self.quantized.to_json(),
            "memory_estimate": None if self.memory_estimate is None else self.memory_estimate.to_json(),
            "weight_bytes": self.weight_bytes,
            "genai": {} if self.genai is None else self.genai.to_json(),
            "target": self.target, "target_why": self.target_why, "kv_cache": self.kv_cache,
            "kv_cache_why": self.kv_cache_why, "kv_cache_check": {} if self.kv_cache_check is None else self.kv_cache_check.to_json(),
            "transformers_vs_ours": {} if self.transformers_vs_ours is None else self.transformers_vs_ours.to_json(),
            "norm_ops": self.norm_ops,
        }


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


def worst(per_session: dict, name: str | None = None) -> float:
    """The largest diff of output `name` (None: of every output) in {session: {output: diff}}."""
    vals = [v for d in per_session.values() for k, v in d.items() if name is None or k == name]
    return max(vals, default=0.0)


# --- the summary -------------------------------------------------------------------------------------

def by_pass(names) -> str:
    """'taper_scale 8, norm_gamma 1': the sites each graph pass rewrote, in the order the passes ran."""
    return ", ".join(f"{p} {n}" for p, n in Counter(names).items())


def summary(r: BuildReport, log) -> None:
    """The lines a build ends with: what it built, each check's figure, which graph is for which runtime."""
    from export.target import Target
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
    q = r.quantized
    if q is not None and q.summary.rewritten:
        log(f"  rewrote  {len(q.summary.rewritten)} site(s) of {q.file}: " + by_pass(x["pass"] for x in q.summary.rewritten))
    v = r.verification
    if v.graph_vs_torch:
        log(f"  {GRAPH_VS_TORCH:17s} max |d logits| {v.worst('logits'):.3g}, all outputs {v.worst():.3g} "
            f"(atol {v.atol:g} + {v.scale_tol:g} x max|ref|)")
    if r.transformers_vs_ours is not None:
        log(f"  {r.transformers_vs_ours.line()}")
    if r.kv_cache_why and r.attention == "gqa":       # (where auto had a choice to make)
        log(f"  kv_cache {r.kv_cache_why}")
    if r.kv_cache_check is not None:
        log(f"  kv_cache {r.kv_cache_check.line()}")
    if r.eps_approximation is not None:
        log(f"  eps      {r.eps_approximation.line()}")
    if q is not None:
        s, d = q.summary, q.drift
        log(f"  {q.file}: {s.matmuls_quantized} MatMulNBits, {s.gathers_quantized} GatherBlockQuantized, "
            f"weights {s.weight_bytes_after / 1e6:.1f} MB (fp32 {s.weight_bytes_before / 1e6:.1f} MB); "
            f"logits max |d| vs the float model {d.logits_max_abs_diff:.3g}; "
            f"top-1 agreement {d.teacher_forced_top1:.1%} over {d.top1_positions} positions")
    if r.genai is not None:
        g = r.genai
        log(f"  genai    {g.graph} ({g.source} with GenAI's I/O) + {g.config}"
            f"{' + ' + ', '.join(g.tokenizer_files) if g.tokenizer_files else ''}: og.Model('{r.out}') loads it; "
            f"logits max |d| vs {g.source} {g.logits_max_abs_diff:.3g}")
    log("  " + Target(r.target, r.attention, r.target_why).describe([r.graph]))
    if r.trt_lint and r.target != "ort-cpu":        # an ort-cpu graph is not for TensorRT: the report keeps them
        log(f"  trt_lint {len(r.trt_lint)} issue(s): {r.trt_lint[0]}" + (" ..." if len(r.trt_lint) > 1 else ""))
