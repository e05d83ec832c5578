"""A build's options as one typed object, checked once when it is made (as train/config.py's run
settings and Polygraphy's argument groups are): every combination refused before any work, each
refusal naming its option (a UsageError: the command line is wrong, whatever the model).

    BuildOptions(fuse, dtype, quantize, attention, genai, kv_cache, target_why)   # checked in __post_init__
    BuildOptions.resolved(..., resolve=...)      # export.build's: --quantize checked before the target is
                                                 # resolved (which reads the model's config), the rest after;
                                                 # --kv-cache auto resolved with the target and the capacity

The checks of the options against a model (check_gate, check_dtype) run once the weights are open.
"""
from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import TYPE_CHECKING, Callable

from core.build_files import FUSED, UNFUSED
from core.errors import UsageError, UserError

if TYPE_CHECKING:
    from export.quantize import QuantConfig
    from export.target import Target


class BuildError(UserError):
    """A build that cannot proceed; the message is one line for the user."""


@dataclass(frozen=True)
class BuildOptions:
    """What export.build builds. `attention`: "plain" ops (portable), "fused" (one ONNX Attention op per
    layer) or "gqa" (ONNX Runtime's GroupQueryAttention, graph_passes/ort_attention.py). `quantize`: an
    export.quantize.QuantConfig (needs fuse and fp32). `genai` (needs fuse, fp32, gqa): also the ONNX
    Runtime GenAI folder's files (export/genai.py). `kv_cache`: the caches' dtype (fp16, int8: gqa only).
    `target_why`: why export.build --target auto chose the attention; `kv_cache_why`: why --kv-cache auto chose
    the dtype ("" when the option named it; an auto int8 cache that fails its check falls back to fp32)."""
    fuse: bool
    dtype: str = "fp32"
    quantize: QuantConfig | None = None
    attention: str = "plain"
    genai: bool = False
    kv_cache: str = "fp32"
    target_why: str = ""
    kv_cache_why: str = ""
    quantize_checked: InitVar[bool] = False     # resolved() checked --quantize already, before the target

    def __post_init__(self, quantize_checked: bool) -> None:
        if not quantize_checked:
            check_quantize(self.quantize, self.fuse, self.dtype)
        check_genai(self.genai, self.fuse, self.dtype, self.attention)   # before check_attention: it names the option given
        check_attention(self.attention, self.fuse, self.dtype)
        check_kv_cache(self.kv_cache, self.attention, self.genai)

    @classmethod
    def resolved(cls, fuse: bool, dtype: str, quantize, genai: bool, kv_cache: str,
                 resolve: Callable[[], Target], capacity: Callable[[], int] | None = None) -> BuildOptions:
        """export.build's options: --quantize checked first, then `resolve()` picks the target (export/target.py;
        it may read the model's config, whose errors are the input's), then --kv-cache auto (auto_kv_cache, at the
        graph's `capacity()`), then the rest; each check once."""
        check_quantize(quantize, fuse, dtype)
        target = resolve()
        why = ""
        if kv_cache == "auto":
            decides = target.attention == "gqa" and not genai and capacity is not None   # (only then is it read)
            kv_cache, why = auto_kv_cache(target.attention, genai, capacity() if decides else 0)
        return cls(fuse, dtype, quantize, target.attention, genai, kv_cache, target.why, why, quantize_checked=True)

    @property
    def kv_cache_falls_back(self) -> bool:
        """--kv-cache auto chose it: an int8 cache that fails its check leaves the fp32 cache, not a failed build."""
        return bool(self.kv_cache_why)

    @property
    def graph_name(self) -> str:
        """The graph file the build writes."""
        return self.quantize.file_name() if self.quantize is not None else (FUSED if self.fuse else UNFUSED)

    @property
    def graph_kind(self) -> str:
        """The written graph's key in the report's op counts: int4 / int8, fused or unfused."""
        return graph_kind(self.fuse, self.quantize)

    @property
    def tolerance_key(self) -> str:
        return tolerance_key(self.dtype, self.kv_cache, self.quantize)


def graph_kind(fuse: bool, quantize) -> str:
    return quantize.dtype if quantize is not None else ("fused" if fuse else "unfused")


def tolerance_key(dtype: str, cache: str, quantize) -> str:
    """export.verify's tolerance a written graph is checked with: a quantized graph's (rtn: against its own
    dequantized weights, the reference that has them), else its float dtype's (verified_as)."""
    from export.verify import DEQUANTIZED
    if quantize is not None:
        return DEQUANTIZED if quantize.algo == "rtn" else quantize.dtype
    return verified_as(dtype, cache)


def verified_as(dtype: str, cache: str) -> str:
    """The tolerance key of a float graph: its dtype, or fp16's for an fp32 graph with an fp16 cache (an fp16
    cache is one of the roundings a whole fp16 graph has; the caches it writes are fp16 values)."""
    return "fp16" if dtype == "fp32" and cache == "fp16" else dtype


# --- the options alone ---------------------------------------------------------------------------

def require_fused_fp32(option: str, fuse: bool, dtype: str, why_fuse: str, why_fp32: str,
                       fix: str = "drop --dtype") -> None:
    """An option that works on the folded fp32 graph: refuse it (UsageError) without --fuse or at another dtype."""
    if not fuse:
        raise UsageError(f"{option}: expected --fuse too ({why_fuse}); add --fuse")
    if dtype != "fp32":
        raise UsageError(f"{option}: expected --dtype fp32 ({why_fp32}), found --dtype {dtype}; {fix}")


def check_quantize(quantize, fuse: bool, dtype: str) -> None:
    """--quantize quantizes the folded fp32 graph: refuse other combinations before any work."""
    if quantize is not None:
        require_fused_fp32(f"--quantize {quantize.dtype}", fuse, dtype, "the folded graph is what gets quantized",
                           "weights are quantized from fp32")
        quantize.validate()


def check_genai(genai: bool, fuse: bool, dtype: str, attention: str) -> None:
    """--genai writes the folded fp32 GroupQueryAttention graph: refuse other combinations before any work."""
    if not genai:
        return
    require_fused_fp32("--genai", fuse, dtype, "GenAI gets the folded graph",
                       "GenAI's CPU GroupQueryAttention is fp32; --quantize int4 for smaller weights")
    if attention != "gqa":
        raise UsageError(f"--genai: expected --attention gqa (GenAI shares one cache buffer between past and present, "
                         f"which GroupQueryAttention writes in place), found --attention {attention}; drop --attention")


def check_attention(attention: str, fuse: bool, dtype: str) -> None:
    """--attention gqa rewrites the folded fp32 graph for ONNX Runtime's CPU kernel: refuse other combinations."""
    if attention == "gqa":
        require_fused_fp32("--attention gqa", fuse, dtype, "the GroupQueryAttention rewrite runs after the fold",
                           "ONNX Runtime's CPU GroupQueryAttention is fp32 only",
                           "drop --dtype or use --attention fused")


# --kv-cache auto's int8 cache from this capacity on: where contexts get long enough for the cache's bytes to
# dominate a decode step (the Qwen3-0.6B shape, int4: int8 1.2x the fp32 cache at depth 1024, 1.5x at 4096,
# 1.9x at 8192; docs/bench.md), and the calibration and check it adds to a build pay for themselves.
INT8_CACHE_FROM = 4096


def auto_kv_cache(attention: str, genai: bool, capacity: int) -> tuple[str, str]:
    """--kv-cache auto (the default): (the caches' dtype, why). int8 for ONNX Runtime's CPU graph at a capacity of
    INT8_CACHE_FROM or more, checked against the fp32 cache like --kv-cache int8 but kept fp32 where it drifts past
    its bound (export/kv_int8.py); fp32 otherwise (the portable graph and GenAI's folder keep fp32 caches; fp16 is
    no faster on the CPUs measured, docs/export.md)."""
    if attention != "gqa":
        return "fp32", f"auto: fp32 ({attention} attention: the portable graph's caches are fp32)"
    if genai:
        return "fp32", "auto: fp32 (--genai: GenAI's folder keeps an fp32 cache)"
    if capacity < INT8_CACHE_FROM:
        return "fp32", f"auto: fp32 (capacity {capacity} < {INT8_CACHE_FROM} tokens; --kv-cache int8 for long contexts)"
    return "int8", (f"auto: int8 (capacity {capacity} >= {INT8_CACHE_FROM} tokens on ONNX Runtime's CPU graph; "
                    "kept fp32 if it drifts past its bound)")


def check_kv_cache(kv_cache: str, attention: str, genai: bool) -> None:
    """--kv-cache fp16 / int8 are GroupQueryAttention's (graph_passes/ort_attention.py's with_cache_dtype,
    with_int8_cache): refuse them for the portable graph and for GenAI's folder (not verified there)."""
    if kv_cache == "fp32":
        return
    if attention != "gqa":
        raise UsageError(f"--kv-cache {kv_cache}: expected the ONNX Runtime CPU graph (--target ort-cpu: "
                         f"GroupQueryAttention), found {attention} attention (--target portable); add --fuse "
                         "--target ort-cpu, or drop --kv-cache")
    if genai:
        raise UsageError(f"--kv-cache {kv_cache}: expected a build without --genai (GenAI's folder keeps an fp32 "
                         "cache), found --genai; drop one of them")


# --- the options against the model -----------------------------------------------------------------

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
