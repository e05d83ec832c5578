"""The models a decode benchmark compares: sizes, variants, and how each is built.

    size     an architecture (SIZES); trained zoo weights where models/zoo/<kind> has that
             shape and a finished taper, random weights otherwise (`source` says which)
    kind     the trained model a variant starts from: baseline | internal-taper | all-taper | dyt
    variant  kind + how it is deployed, as data (VARIANTS): a model transform (TRANSFORMS) and
             whether the norms are folded:

    | variant                 | kind           | ONNX (ort, trt)                          | torch (eager)                       |
    |-------------------------|----------------|------------------------------------------|-------------------------------------|
    | rmsnorm-strong          | baseline       | RMSNormalization op, gamma folded        | F.rms_norm without weight, gamma folded |
    | rmsnorm-plain           | baseline       | naive x*rsqrt(mean(x^2)+eps)*w, no passes | the same naive module              |
    | internal-taper-unfused  | internal-taper | as exported: Mul by c*gamma_tilde kept   | TaperNorm at g = 0 (one mul)        |
    | internal-taper-fused    | internal-taper | graph_passes (DEFAULT_PASSES)            | scales folded, norm -> Identity     |
    | all-taper-fused         | all-taper      | graph_passes                             | scales folded, final included       |
    | dyt                     | dyt            | graph_passes (gamma/beta folded)         | tanh(alpha x) left, gamma/beta folded |

ONNX files come from export.pipeline's graph stages (build_graph: emitted, folded, quantized,
written, each verified as export.build verifies it, unless the bench runs with --no-verify),
written into the build cache by core.outputs and core.onnx_writer. The torch variants fold with
models.fold.fold_norms.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from core.onnx_writer import replaced_graph_in
from core.outputs import replace_file_in
from models.decoder import Decoder, DecoderConfig
from models.fold import FOLDED_NORM_CLASSES, fold_norms
from models.norms import DyT, LayerNorm, RMSNorm, TaperNorm

ZOO = Path(__file__).resolve().parent.parent / "models" / "zoo"

# GPT-2 style (gelu MLP x4, tied head); params are printed by `python -m bench.decode --list`.
SIZES: dict[str, dict] = {
    "1M": dict(d_model=128, n_layer=4, n_head=4, vocab_size=2048),      # train.presets "tiny"
    "8M": dict(d_model=384, n_layer=4, n_head=6, vocab_size=2048),      # 4-layer shapes as TinyStories'
    "30M": dict(d_model=768, n_layer=4, n_head=12, vocab_size=2048),    # 33M (export time grows with depth)
    "124M": dict(d_model=768, n_layer=12, n_head=12, vocab_size=50257),  # GPT-2 small
}
KINDS: dict[str, dict] = {
    "baseline": dict(norm="rmsnorm"),
    "internal-taper": dict(norm="taper", taper_scope="internal"),
    "all-taper": dict(norm="taper", taper_scope="all"),
    "dyt": dict(norm="dyt"),
}


@dataclass(frozen=True)
class Variant:
    """One deployment, as data: the kind's model, a model transform before export and before the
    torch runners (a key of TRANSFORMS, None: as trained), and whether the norms are folded
    (ONNX: export.graph_stages' fuse stage; torch: models.fold.fold_norms)."""
    name: str
    kind: str
    transform: str | None = None
    fuse: bool = False

    @property
    def model_key(self) -> tuple[str, str | None]:
        """Variants with the same key share one model and one export (internal-taper unfused and fused)."""
        return self.kind, self.transform


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("rmsnorm-strong", "baseline", fuse=True),
    Variant("rmsnorm-plain", "baseline", transform="naive-rmsnorm"),
    Variant("internal-taper-unfused", "internal-taper"),
    Variant("internal-taper-fused", "internal-taper", fuse=True),
    Variant("all-taper-fused", "all-taper", fuse=True),
    Variant("dyt", "dyt", fuse=True),
)}
BASELINE = "rmsnorm-strong"
# which norms of rmsnorm-strong a variant removes (for the profiled limit 1 / (1 - f))
REMOVES = {"internal-taper-unfused": "blocks", "internal-taper-fused": "blocks", "all-taper-fused": "all"}

def capacity_for(prompt: int, new_tokens: int) -> int:
    """KV-cache capacity: prompt + new tokens rounded up to a multiple of 32, so attention is not inflated."""
    return -(-(prompt + new_tokens) // 32) * 32


def config_for(size: str, kind: str, capacity: int) -> DecoderConfig:
    return DecoderConfig(**SIZES[size], **KINDS[kind], max_seq_len=capacity)


# --- base models ---------------------------------------------------------------------------

def _zoo_model(size: str, kind: str, capacity: int):
    """The trained zoo model of this kind when it has this size's shape and a finished taper."""
    where = ZOO / kind
    if not (where / "config.json").is_file() or not (where / "model.safetensors").is_file():
        return None, f"no models/zoo/{kind}"
    raw = json.loads((where / "config.json").read_text())
    shape = {k: raw.get(k) for k in SIZES[size]}
    if shape != SIZES[size]:
        return None, f"models/zoo/{kind} has shape {shape}, not {size}"
    if raw.get("max_seq_len", 0) < capacity:
        return None, f"models/zoo/{kind} capacity {raw.get('max_seq_len')} < {capacity}"
    from models.checkpoint import load_checkpoint
    model = load_checkpoint(where)
    if kind.endswith("taper") and model.gate.value != 0.0:
        return None, f"models/zoo/{kind} gate is {model.gate.value:g}, not 0"
    digest = hashlib.sha1((where / "model.safetensors").read_bytes()).hexdigest()[:10]
    return _with_capacity(model, capacity), f"zoo:{kind}@{digest}"


def _with_capacity(model: Decoder, capacity: int) -> Decoder:
    """Same weights, KV-cache capacity (and position table) cut to `capacity`."""
    cfg = replace(model.cfg, max_seq_len=capacity)
    torch.manual_seed(0)
    out = Decoder(cfg)
    state = model.state_dict()
    state["wpe.weight"] = state["wpe.weight"][:capacity].clone()
    out.load_state_dict(state)
    for name, layer in out.taper_layers().items():
        layer.c = model.taper_layers()[name].c
    out.set_gate(model.gate.value)
    return out.eval()


@torch.no_grad()
def _random_model(size: str, kind: str, capacity: int, seed: int) -> Decoder:
    """Random linear weights (the same for every kind of a size: same seed, same init order),
    norm gains ~ 1 + 0.2 N(0,1), DyT alpha 0.7; TaperNorm c calibrated on random tokens at
    g = 1 (least squares, as train/ does), then g = 0: random but sane activations."""
    torch.manual_seed(seed)
    model = Decoder(config_for(size, kind, capacity)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "ln_" in name:
            if name.endswith("alpha"):
                p.fill_(0.7)
            elif "weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    layers = model.taper_layers()
    if layers:
        seen: dict[str, torch.Tensor] = {}
        hooks = [m.register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, a[0].detach()))
                 for n, m in layers.items()]
        ids = torch.randint(0, model.cfg.vocab_size, (2, min(32, capacity)), generator=gen)
        model(ids)
        for h in hooks:
            h.remove()
        for n, m in layers.items():
            m.calibrate([seen[n]])
        model.set_gate(0.0)
    return model


def base_model(size: str, kind: str, capacity: int, seed: int = 0) -> tuple[Decoder, str]:
    """(model, source): zoo weights where they fit, else random ('random:seed<N>' + why)."""
    model, why = _zoo_model(size, kind, capacity)
    if model is not None:
        return model, why
    return _random_model(size, kind, capacity, seed), f"random:seed{seed} ({why})"


# --- torch-side variants --------------------------------------------------------------------

class NaiveRMSNorm(nn.Module):
    """What a hand-written RMSNorm exports as: Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul/Mul."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(weight.detach().clone())

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


NORM_CLASSES = (RMSNorm, LayerNorm, TaperNorm, DyT, NaiveRMSNorm, *FOLDED_NORM_CLASSES)


def naive_rmsnorm(model: Decoder) -> Decoder:
    """A copy with every RMSNorm module replaced by NaiveRMSNorm (same weights)."""
    model = copy.deepcopy(model)
    for name, m in list(model.named_modules()):
        if isinstance(m, RMSNorm):
            path, _, attr = name.rpartition(".")
            setattr(model.get_submodule(path), attr, NaiveRMSNorm(m.weight, m.eps))     # path "": the model
    return model.eval()


# Variant.transform -> the model transform (a copy; the trained model is left as it is), for the torch
# runners; the ONNX graph of a transform is the emitter's form of the same model (export/emit.py `rmsnorm`)
TRANSFORMS = {"naive-rmsnorm": naive_rmsnorm}
RMSNORM_FORMS = {"naive-rmsnorm": "naive"}


def transformed(variant: Variant, model: Decoder) -> Decoder:
    """The model a variant exports (and the torch runners run before any fold)."""
    return TRANSFORMS[variant.transform](model) if variant.transform else model.eval()


def torch_variant(variant: Variant, model: Decoder) -> Decoder:
    model = transformed(variant, model)
    return fold_norms(model) if variant.fuse else model


def weight_bytes_torch(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: every parameter once, but not the position
    table (one row per step) nor an untied token embedding (one row per token)."""
    skip = {id(model.wpe.weight)} if hasattr(model, "wpe") else set()
    if model.lm_head.weight is not model.wte.weight:
        skip.add(id(model.wte.weight))
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)     # each once


# --- runner names ----------------------------------------------------------------------------

def quantized_name(name: str, dtype: str) -> str:
    """The runner name of a variant's weight-quantized graph: rmsnorm-strong.int4."""
    return name if dtype == "fp32" else f"{name}.{dtype}"


def split_name(name: str) -> tuple[str, str]:
    """(variant, dtype) of a runner name: 'rmsnorm-strong.int4' -> ('rmsnorm-strong', 'int4')."""
    base, _, dtype = name.partition(".")
    return base, dtype or "fp32"


# --- what a built graph is -----------------------------------------------------------------------

NORM_CLASS_NAMES = tuple(c.__name__ for c in NORM_CLASSES)
NORM_OP_TYPES = ("RMSNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                 "LayerNormalization", "SkipLayerNormalization")


def norm_nodes(proto) -> dict[str, str]:
    """node name -> 'block' | 'final' for nodes the exporter attributed to a norm module (their
    torch provenance, as graph_passes reads it), and norm ops (ONNX Runtime may rename what it fuses)."""
    from graph_passes.base import NAME_SCOPES, PassContext
    ctx = PassContext(proto)
    out = {}
    for n in ctx.graph.nodes:
        if any(c.rsplit(".", 1)[-1] in NORM_CLASS_NAMES for c in ctx.module_class(n)):
            out[n.name] = "final" if any(s.endswith("ln_f") for s in ctx.scopes_of(n, NAME_SCOPES)) else "block"
        elif n.op in NORM_OP_TYPES:
            out[n.name] = "block"
    return out


@dataclass
class GraphInfo:
    """One cache entry: a built graph and what the bench reads of it; its JSON is the entry's
    meta file (beside the .onnx) and travels to the worker processes."""
    path: str
    source: str                     # zoo:<kind>@<sha1> | random:seed<N> (why)
    weight_bytes: int               # bytes a decode step reads (core.onnx_writer.initializer_bytes per_step)
    params: int
    nodes: int
    norm_nodes: dict[str, str]
    op_counts: dict[str, int]
    export_s: float                 # emitting the graph (and recording its folds)
    build_s: float
    built_by: str                   # build_fingerprint() of the code that built it
    verified: dict | None = None    # export's checks (verification()); None: built with --no-verify
    quantized: dict | None = None   # the QuantConfig of a quantized graph

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not (k == "quantized" and v is None)}

    @classmethod
    def from_json(cls, data: dict) -> "GraphInfo":
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__ if k in data})


def verification(report, kind: str, verify: bool) -> dict | None:
    """What export's checks of one graph found (its export.report.BuildReport): the tolerance, the
    worst logits / any-output diff, and a quantized graph's drift (top-1 agreement included); None
    when verification is off."""
    from export.quantize import MIN_TOP1
    from export.report import GRAPH_VS_TORCH
    if not verify:
        return None
    r, key = report, kind if kind in MIN_TOP1 else "fp32"
    v = r.verification
    tolerance = {"dtype": key, "atol": v.atol, "scale_tol": v.scale_tol}
    pairs = [GRAPH_VS_TORCH] if v.graph_vs_torch else []
    out = {"tolerance": tolerance,
           "logits_max_abs_diff": {pair: v.worst("logits") for pair in pairs},
           "max_abs_diff": {pair: v.worst() for pair in pairs}}
    if key in MIN_TOP1:
        tolerance["min_top1"] = MIN_TOP1[key]
        tolerance["min_top1_enforced"] = not any("not enforced" in n for n in r.notes)
        out["drift"] = r.quantized.drift.to_json()
    return out


def verified_line(v: dict | None) -> str:
    if v is None:
        return "NOT verified (--no-verify)"
    diffs = ", ".join(f"{pair} {d:.3g}" for pair, d in v["logits_max_abs_diff"].items())
    floor = "floor" if v["tolerance"].get("min_top1_enforced", True) else "random weights: a trained model's floor"
    top1 = (f", top-1 {v['drift']['top1_agreement']:.1%} ({floor} {v['tolerance']['min_top1']:.0%})"
            if "drift" in v else "")
    t = v["tolerance"]
    # a quantized graph is checked against its own dequantized weights, within that check's bound
    against = f"{t['dtype']} vs its dequantized weights" if "min_top1" in t else t["dtype"]
    return f"verified ({against}, atol {t['atol']:g} + {t['scale_tol']:g} x max|ref|): max |d logits| {diffs}{top1}"


# --- ONNX builds --------------------------------------------------------------------------------

GRAPH_CODE = ("models", "export", "graph_passes")      # the packages whose code decides a built graph


@functools.lru_cache(maxsize=1)
def build_fingerprint() -> str:
    """What a cached graph was built by: a hash of the code that writes graphs (GRAPH_CODE) and of
    the torch, onnx and onnxruntime versions. A cache entry with another fingerprint is rebuilt:
    a new pass or a fixed fusion changes a graph without changing its file name, and a bench
    that kept serving the old graph would time code that no longer ships."""
    import onnx
    import onnxruntime
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(f"torch {torch.__version__} onnx {onnx.__version__} ort {onnxruntime.__version__}".encode())
    for pkg in GRAPH_CODE:
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _cached(meta_path: Path, label: str, log, verified: bool = False) -> GraphInfo | None:
    """A cache entry's info when its graph was built by this code (and, with `verified`, was
    verified: a run that verifies does not time a graph nobody checked), else None (say why once)."""
    if not meta_path.is_file() or not meta_path.with_suffix(".onnx").is_file():
        return None
    try:
        info = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:          # a half-written or hand-edited entry: build it again
        log(f"  rebuilding {label}: its cache entry {meta_path.name} is unreadable ({type(e).__name__})")
        return None
    if not isinstance(info, dict) or info.get("built_by") != build_fingerprint():
        built_by = info.get("built_by", "unrecorded") if isinstance(info, dict) else "unrecorded"
        log(f"  rebuilding {label}: the cached graph was built by other code ({built_by}, now {build_fingerprint()})")
        return None
    if verified and info.get("verified") is None:
        log(f"  rebuilding {label}: the cached graph was built with --no-verify")
        return None
    try:
        return GraphInfo.from_json(info)
    except TypeError:                           # fields missing: not an entry this code wrote
        log(f"  rebuilding {label}: its cache entry {meta_path.name} lacks fields")
        return None


@dataclass(frozen=True)
class BuildOptions:
    """What every graph of one bench build shares: the cache key's parts and export's options."""
    size: str
    capacity: int
    cache: Path
    dtypes: tuple[str, ...] = ("fp32",)     # the fused variants' weight dtypes (export.quantize, rtn)
    attention: str = "plain"                # plain | fused | gqa (export.build --attention)
    verify: bool = True


@contextlib.contextmanager
def one_line_errors(label: str):
    """A stage's refusal as one plain UserError: the build pool pickles it, and VerificationError
    (two constructor arguments) does not survive that."""
    from core.errors import UserError
    try:
        yield
    except UserError as e:
        raise UserError(f"bench: {label}: {e}; build with --no-verify to time it unverified"
                        if "verification" in str(e) else f"bench: {label}: {e}") from None


class ModelGraphs:
    """The graphs of one model (a kind, transformed): each variant's graph and the quantized graphs of the
    fused ones, each emitted from the model (export.pipeline.build_graph); cache entries reused."""

    def __init__(self, options: BuildOptions, model: Decoder, source: str, tokenizer: Path | None, rmsnorm: str,
                 log):
        from export.reference_check import real_tokens
        from models.weights import model_weights
        self.options, self.source, self.log, self.params = options, source, log, model.num_params()
        self.weights, self.rmsnorm = model_weights(model), rmsnorm
        self.tokens = real_tokens(tokenizer, model.cfg.vocab_size)
        # a random-init model's int4 top-1 agreement is ~20 % whatever the graph: its floor is reported only
        self.trained = not source.startswith("random:")

    def path(self, name: str) -> Path:
        o = self.options
        tag = self.source.split(" ")[0].replace(":", "-").replace("@", "-")
        att = "" if o.attention == "plain" else f"-{o.attention}att"
        return o.cache / f"{o.size}-cap{o.capacity}{att}-{name}-{tag}.onnx"

    def variant(self, v: Variant) -> dict[str, GraphInfo]:
        """runner name -> info: the variant's graph and, fused, its quantized ones."""
        path, o = self.path(v.name), self.options
        with one_line_errors(f"{o.size} {v.name}"):
            info = _cached(path.with_suffix(".json"), f"{o.size} {v.name}", self.log, o.verify)
            if info is None:
                info = self.build(v.name, path, v.fuse)
                self.log(f"  built {o.size} {v.name} ({self.source.split(' ')[0]}): {info.nodes} nodes in "
                         f"{info.build_s:.1f} s, {verified_line(info.verified)}")
            out = {v.name: info}
            for dtype in [d for d in o.dtypes if d != "fp32" and v.fuse]:
                out[quantized_name(v.name, dtype)] = self.quantized(v.name, path, dtype)
        return out

    def build(self, name: str, path: Path, fuse: bool, quantize=None) -> GraphInfo:
        """One graph of the model into the cache (fused, or for ONNX Runtime's attention the rewrite alone;
        quantized), verified unless the bench runs with --no-verify."""
        from export.options import graph_kind
        from export.pipeline import build_graph
        o = self.options
        t0 = time.perf_counter()
        with replaced_graph_in(o.cache, path.name) as tmp:     # signed, replaced atomically; a refused graph leaves none
            report = build_graph(self.weights, tmp, fuse, o.attention, quantize, fold=fuse, verify=o.verify,
                                 trained=self.trained, tokens=self.tokens, rmsnorm=self.rmsnorm)
            info = self.info(report, graph_kind(fuse, quantize), tmp, path, time.perf_counter() - t0)
        if quantize is not None:
            info.quantized = report.quantized.summary.config
        write_meta(o.cache, path, info)
        return info

    def quantized(self, name: str, path: Path, dtype: str) -> GraphInfo:
        """The fused graph's weights in `dtype` (export.quantize: rtn, block 32, accuracy level 4), built once."""
        from export.quantize import QuantConfig
        qname = quantized_name(name, dtype)
        qpath = path.with_name(path.name.replace(f"-{name}-", f"-{qname}-"))
        info = _cached(qpath.with_suffix(".json"), qname, self.log, self.options.verify)
        if info is None:
            info = self.build(qname, qpath, True, QuantConfig(dtype))
            self.log(f"  built {qname}: {info.op_counts.get('MatMulNBits', 0)} MatMulNBits in {info.build_s:.1f} s, "
                     f"{verified_line(info.verified)}")
        return info

    def info(self, report, kind: str, written: Path, path: Path, build_s: float) -> GraphInfo:
        import onnx
        from core.onnx_writer import initializer_bytes
        proto = onnx.load(str(written), load_external_data=False)        # the structure: sizes are in the dims
        return GraphInfo(str(path), self.source, initializer_bytes(proto, per_step=True), self.params,
                         len(proto.graph.node), norm_nodes(proto), report.op_counts[kind],
                         round(report.timings_s.get("graph", 0.0), 2), round(build_s, 2), build_fingerprint(),
                         verification(report, kind, self.options.verify))


def write_meta(cache: Path, path: Path, info: GraphInfo) -> None:
    """A cache entry's meta file, written after its graph (an entry is served only when both are there)."""
    replace_file_in(cache, path.with_suffix(".json").name, json.dumps(info.to_json(), indent=1))


def build_onnx(size: str, variants: list[str], capacity: int, cache: Path, seed: int = 0, log=print,
               dtypes=("fp32",), attention: str = "plain", verify: bool = True) -> dict[str, GraphInfo]:
    """Build each variant once into `cache` through export.pipeline's stages; returns runner name
    -> GraphInfo. Variants of one model share its export; cache entries built by this code are
    reused. Each fused variant is also quantized to every dtype in `dtypes` other than fp32, as
    '<variant>.<dtype>'. attention: "plain" ops, "fused" (one ONNX Attention op per layer) or
    "gqa" (ONNX Runtime's GroupQueryAttention, export.build --attention gqa). verify=False: no
    graph is checked against torch (GraphInfo.verified None), and the caller says so."""
    cache.mkdir(parents=True, exist_ok=True)
    options = BuildOptions(size, capacity, Path(cache), tuple(dtypes), attention, verify)
    base = functools.cache(lambda kind: base_model(size, kind, capacity, seed))       # once per kind
    graphs: dict[tuple, ModelGraphs] = {}
    out: dict[str, GraphInfo] = {}
    for name in variants:
        v = VARIANTS[name]
        model, source = base(v.kind)
        if v.model_key not in graphs:
            tokenizer = ZOO / v.kind / "tokenizer.json" if source.startswith("zoo:") else None
            graphs[v.model_key] = ModelGraphs(options, model, source, tokenizer if tokenizer and tokenizer.is_file()
                                              else None, RMSNORM_FORMS.get(v.transform, "op"), log)
        out.update(graphs[v.model_key].variant(v))
    return out
