"""The models a decode benchmark compares: sizes, variants, and how each is built.

    size     an architecture (SIZES); trained zoo weights where models/zoo/<kind> has that
             shape and a finished taper, random weights otherwise (`source` says which)
    kind     the trained model a variant starts from: baseline | internal-taper | all-taper | dyt
    variant  kind + how it is deployed:

    | variant                 | kind           | ONNX (ort, trt)                          | torch (eager)                       |
    |-------------------------|----------------|------------------------------------------|-------------------------------------|
    | rmsnorm-strong          | baseline       | RMSNormalization op, gamma folded        | F.rms_norm without weight, gamma folded |
    | rmsnorm-plain           | baseline       | naive x*rsqrt(mean(x^2)+eps)*w, no passes | the same naive module              |
    | internal-taper-unfused  | internal-taper | as exported: Mul by c*gamma_tilde kept   | TaperNorm at g = 0 (one mul)        |
    | internal-taper-fused    | internal-taper | graph_passes (DEFAULT_PASSES)            | scales folded, norm -> Identity     |
    | all-taper-fused         | all-taper      | graph_passes                             | scales folded, final included       |
    | dyt                     | dyt            | graph_passes (gamma/beta folded)         | tanh(alpha x) left, gamma/beta folded |

ONNX files come from export.onnx_export.export_onnx and graph_passes.run_passes (the same
library calls export.build makes, without its torch-vs-ORT verification, which
tests/export covers). The torch variants fold with models.fold.fold_norms.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

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
    name: str
    kind: str
    naive: bool = False   # rmsnorm-plain: swap RMSNorm for the naive formula
    fuse: bool = False    # run graph_passes (ONNX) / fold into the linears (torch)


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("rmsnorm-strong", "baseline", fuse=True),
    Variant("rmsnorm-plain", "baseline", naive=True),
    Variant("internal-taper-unfused", "internal-taper"),
    Variant("internal-taper-fused", "internal-taper", fuse=True),
    Variant("all-taper-fused", "all-taper", fuse=True),
    Variant("dyt", "dyt", fuse=True),
)}
BASELINE = "rmsnorm-strong"
# which norms of rmsnorm-strong a variant removes (for the profiled limit 1 / (1 - f))
REMOVES = {"internal-taper-unfused": "blocks", "internal-taper-fused": "blocks", "all-taper-fused": "all"}


def capacity_for(prompt: int, new_tokens: int, multiple: int = 32) -> int:
    """KV-cache capacity: prompt + new tokens rounded up, so attention is not inflated."""
    need = prompt + new_tokens
    return -(-need // multiple) * multiple


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
            parent, attr = _parent(model, name)
            setattr(parent, attr, NaiveRMSNorm(m.weight, m.eps))
    return model


def _parent(model: nn.Module, name: str):
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def torch_variant(variant: Variant, model: Decoder) -> Decoder:
    if variant.naive:
        return naive_rmsnorm(model).eval()
    return fold_norms(model) if variant.fuse else model.eval()


def weight_bytes_torch(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: every parameter once, but not the position
    table (one row per step) nor an untied token embedding (one row per token)."""
    params = {id(p): p for p in model.parameters()}
    skip = {id(model.wpe.weight)}
    if model.lm_head.weight is not model.wte.weight:
        skip.add(id(model.wte.weight))
    return sum(p.numel() * p.element_size() for k, p in params.items() if k not in skip)


# --- ONNX builds --------------------------------------------------------------------------------

NORM_CLASS_NAMES = tuple(c.__name__ for c in NORM_CLASSES)
NORM_OP_TYPES = ("RMSNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                 "LayerNormalization", "SkipLayerNormalization")


def onnx_weight_bytes(proto) -> int:
    """Initializer bytes a step reads: all but tensors consumed only by Gather (embeddings,
    GatherBlockQuantized when quantized: one row per token)."""
    import numpy as np
    from onnx.helper import tensor_dtype_to_np_dtype
    consumers: dict[str, set] = {}
    for n in proto.graph.node:
        for i in n.input:
            consumers.setdefault(i, set()).add(n.op_type)
    total = 0
    for t in proto.graph.initializer:
        if consumers.get(t.name, set()) <= {"Gather", "GatherBlockQuantized"} and t.name in consumers:
            continue
        total += int(np.prod(t.dims, dtype=np.int64)) * tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total


def norm_nodes(proto) -> dict[str, str]:
    """node name -> 'block' | 'final' for nodes the exporter attributed to a norm module."""
    import ast
    out = {}
    for n in proto.graph.node:
        meta = {p.key: p.value for p in n.metadata_props}
        try:
            classes = ast.literal_eval(meta.get("pkg.torch.onnx.class_hierarchy", "[]"))
            scopes = ast.literal_eval(meta.get("pkg.torch.onnx.name_scopes", "[]"))
        except (ValueError, SyntaxError):
            continue
        if any(str(c).rsplit(".", 1)[-1] in NORM_CLASS_NAMES for c in classes):
            out[n.name] = "final" if any(str(s).endswith("ln_f") for s in scopes) else "block"
        elif n.op_type in NORM_OP_TYPES:
            out[n.name] = "block"
    return out


def quantized_name(name: str, dtype: str) -> str:
    """The runner name of a variant's weight-quantized graph: rmsnorm-strong.int4."""
    return name if dtype == "fp32" else f"{name}.{dtype}"


def split_name(name: str) -> tuple[str, str]:
    """(variant, dtype) of a runner name: 'rmsnorm-strong.int4' -> ('rmsnorm-strong', 'int4')."""
    base, _, dtype = name.partition(".")
    return base, dtype or "fp32"


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


def _cached(meta_path: Path, label: str, log) -> dict | None:
    """A cache entry's info when its graph was built by this code, else None (say why once)."""
    if not meta_path.is_file() or not meta_path.with_suffix(".onnx").is_file():
        return None
    try:
        info = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:          # a half-written or hand-edited entry: build it again
        log(f"  rebuilding {label}: its cache entry {meta_path.name} is unreadable ({type(e).__name__})")
        return None
    if isinstance(info, dict) and info.get("built_by") == build_fingerprint():
        return info
    built_by = info.get("built_by", "unrecorded") if isinstance(info, dict) else "unrecorded"
    log(f"  rebuilding {label}: the cached graph was built by other code ({built_by}, now {build_fingerprint()})")
    return None


def build_onnx(size: str, variants: list[str], capacity: int, cache: Path, seed: int = 0, log=print,
               dtypes=("fp32",), attention: str = "plain") -> dict:
    """Export (and fuse) each variant once into `cache`; returns name -> info (path, source,
    weight bytes, op counts, norm nodes). Files already built for the same weights are reused.
    Each fused variant is also quantized (export.quantize, rtn, block 32, accuracy level 4) to
    every dtype in `dtypes` other than fp32, as '<variant>.<dtype>'. attention: "plain" ops,
    "fused" (one ONNX Attention op per layer, export_onnx(attention=...)) or "gqa" (fused, then
    rewritten to ONNX Runtime's GroupQueryAttention after the fold: graph_passes.passes_for)."""
    import logging
    import onnx
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    from export.onnx_export import export_onnx
    from graph_passes import passes_for, run_passes
    from graph_passes.registry import ORT_PASSES
    cache.mkdir(parents=True, exist_ok=True)
    out, models, exported = {}, {}, {}
    for name in variants:
        v = VARIANTS[name]
        if v.kind not in models:
            models[v.kind] = base_model(size, v.kind, capacity, seed)
        model, source = models[v.kind]
        tag = source.split(" ")[0].replace(":", "-").replace("@", "-")
        att = "" if attention == "plain" else f"-{attention}att"
        path = cache / f"{size}-cap{capacity}{att}-{name}-{tag}.onnx"
        meta_path = path.with_suffix(".json")
        cached = _cached(meta_path, f"{size} {name}", log)
        if cached is not None:
            out[name] = cached
            _quantized_variants(out, name, v, path, None, dtypes, log)
            continue
        t0 = time.perf_counter()
        tmp = path.with_suffix(".tmp.onnx")
        key = (v.kind, v.naive)
        if key not in exported:        # internal-taper's unfused and fused graphs share one export
            src = naive_rmsnorm(model) if v.naive else model
            exported[key] = export_onnx(src, tmp, "fp32", attention="fused" if attention == "gqa" else attention)
        proto = exported[key]
        t_export = time.perf_counter() - t0
        passes = passes_for(attention) if v.fuse else ORT_PASSES if attention == "gqa" else ()
        if passes:
            proto, _ = run_passes(proto, passes)
        onnx.save(proto, str(tmp))
        tmp.replace(path)
        info = {"path": str(path), "source": source, "weight_bytes": onnx_weight_bytes(proto),
                "params": model.num_params(), "nodes": len(proto.graph.node),
                "norm_nodes": norm_nodes(proto), "export_s": round(t_export, 2),
                "build_s": round(time.perf_counter() - t0, 2),
                "op_counts": _op_counts(proto), "built_by": build_fingerprint()}
        meta_path.write_text(json.dumps(info, indent=1))
        out[name] = info
        log(f"  built {size} {name} ({source.split(' ')[0]}): {info['nodes']} nodes in {info['build_s']:.1f} s")
        _quantized_variants(out, name, v, path, proto, dtypes, log)
    return out


def _quantized_variants(out: dict, name: str, v: Variant, path: Path, proto, dtypes, log) -> None:
    """out['<name>.<dtype>'] for each quantized dtype of a fused variant (built once, then reused)."""
    import onnx
    from core.contract import load_onnx
    from export.quantize import QuantConfig, quantize_weights
    for dtype in dtypes:
        if dtype == "fp32" or not v.fuse:
            continue
        qname = quantized_name(name, dtype)
        qpath = path.with_name(path.name.replace(f"-{name}-", f"-{qname}-"))
        meta = qpath.with_suffix(".json")
        cached = _cached(meta, qname, log)
        if cached is not None:
            out[qname] = cached
            continue
        t0 = time.perf_counter()
        fp32 = proto if proto is not None else load_onnx(path)
        q, summary = quantize_weights(fp32, QuantConfig(dtype))
        verified = _verify_quantized(fp32, q)
        tmp = qpath.with_suffix(".tmp.onnx")
        onnx.save(q, str(tmp))
        tmp.replace(qpath)
        info = dict(out[name], path=str(qpath), weight_bytes=onnx_weight_bytes(q), nodes=len(q.graph.node),
                    norm_nodes=norm_nodes(q), build_s=round(time.perf_counter() - t0, 2), op_counts=_op_counts(q),
                    quantized=summary.config, verified=verified)
        meta.write_text(json.dumps(info, indent=1))
        out[qname] = info
        log(f"  built {qname}: {summary.matmuls_quantized} MatMulNBits in {info['build_s']:.1f} s, "
            f"{_verified_line(verified)}")


def _verify_quantized(fp32, q) -> dict:
    """export.verify's check of a quantized graph against the fp32 graph it came from, with the
    weight dtype's tolerance (export.verify ATOL / SCALE_TOL); raises VerificationError beyond it."""
    from export.quantize import QuantizeError
    from export.verify import ATOL, SCALE_TOL, VerificationError, tolerance_key, verify_pair
    key = tolerance_key(fp32, q)
    try:
        results = verify_pair(fp32, q)
    except VerificationError as e:      # re-raised as a one-message error: the build pool pickles it
        raise QuantizeError(f"bench: the {key} graph fails verification against its fp32 graph; {e}") from None
    return {"tolerance": {"dtype": key, "atol": ATOL[key], "scale_tol": SCALE_TOL[key]},
            "logits_max_abs_diff": max(c.max_abs_diff["logits"] for c in results),
            "logits_tolerance": min(c.tolerance["logits"] for c in results)}


def _verified_line(v: dict) -> str:
    return (f"verified vs fp32 ({v['tolerance']['dtype']} tolerance): logits max abs diff "
            f"{v['logits_max_abs_diff']:.3g} <= {v['logits_tolerance']:.3g}")


def _op_counts(proto) -> dict[str, int]:
    from collections import Counter
    return dict(sorted(Counter(n.op_type for n in proto.graph.node).items()))
