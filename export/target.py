"""Which graph a build writes, for which runtime: export.build --target.

    ort-cpu   model.fused.onnx (and model.int4/int8.onnx) with ONNX Runtime's GroupQueryAttention,
              Q/K/V in one MatMul (graph_passes/ort_attention.py): the fastest graph on ONNX
              Runtime's CPU provider; ONNX Runtime only (TensorRT's parser has no com.microsoft ops)
    portable  ONNX ops only (plain attention): TensorRT, ONNX Runtime on any provider, other runtimes
    auto      (default) ort-cpu where the model and options allow it and this machine has no
              TensorRT; else portable, saying why

Why a default that depends on the model: a user who never reads about --attention gqa lost ~20 %
of decode speed on the CPU (issue 25: 0.90x of ONNX Runtime GenAI's own int4 build at 124M with the
portable graph, 1.08x with GroupQueryAttention). --attention stays and decides when given; a
--target that contradicts it is refused.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from core.build_files import QUANTIZED
from core.errors import UsageError

TARGETS = ("auto", "ort-cpu", "portable")
RUNS_ON = {"ort-cpu": "ONNX Runtime on the CPU (GroupQueryAttention: ONNX Runtime only)",
           "portable": "TensorRT and any ONNX runtime (ONNX ops only)"}
FOR = {"ort-cpu": "the fastest ONNX Runtime CPU graph", "portable": "TensorRT and other runtimes"}


@dataclass(frozen=True)
class Target:
    name: str           # ort-cpu | portable
    attention: str      # the graph's attention: gqa for ort-cpu; plain or fused for portable
    why: str = ""       # why auto chose it ("" when the options decided)

    def describe(self, graphs: list[str]) -> str:
        """One line for the build's output: which graph runs where, and how to get the other one."""
        other = "portable" if self.name == "ort-cpu" else "ort-cpu"
        because = f" ({self.why})" if self.why else ""
        quantized = [g for g in graphs if g in QUANTIZED]
        runs = f"; ONNX Runtime given the folder runs {quantized[0]}" if quantized else ""   # model_files.resolve_onnx
        return (f"target   {self.name}{because}: {', '.join(graphs)} for {RUNS_ON[self.name]}{runs}; "
                f"for {FOR[other]}: --target {other}")


def target_of(attention: str) -> str:
    """The target a graph of this attention serves."""
    return "ort-cpu" if attention == "gqa" else "portable"


def resolve_target(target: str, attention: str | None, fuse: bool, dtype: str, genai: bool, cfg) -> Target:
    """The build's target and attention from --target, --attention, --genai and the model (cfg, a
    models.decoder.DecoderConfig); a contradiction is a UsageError naming both options."""
    if attention is not None:                       # the explicit flag decides
        name = target_of(attention)
        if target not in ("auto", name):
            raise UsageError(f"--target {target}: expected --target {name} or none with --attention {attention}, "
                             f"which builds the {name} graph; drop one of the two")
        return Target(name, attention)
    if genai:                                       # GenAI runs the GroupQueryAttention graph only
        if target == "portable":
            raise UsageError("--target portable: expected ort-cpu or none with --genai (GenAI shares one cache buffer "
                             "that GroupQueryAttention writes in place); drop --target portable")
        blocker = cfg is not None and fuse and dtype == "fp32" and ort_cpu_blocker(cfg, fuse, dtype)
        if blocker:                                 # (no --fuse, other dtypes: export.options.check_genai's lines)
            raise UsageError(f"--genai: expected a model ONNX Runtime's GroupQueryAttention takes, found {blocker}; "
                             "GenAI cannot run this model: build without --genai")
        return Target("ort-cpu", "gqa")
    if target == "portable":
        return Target("portable", "plain")
    blocker = ort_cpu_blocker(cfg, fuse, dtype)
    if target == "ort-cpu":
        if blocker:
            raise UsageError(f"--target ort-cpu: expected a model and options ONNX Runtime's GroupQueryAttention "
                             f"takes, found {blocker}; use --target portable")
        return Target("ort-cpu", "gqa")
    if blocker:
        return Target("portable", "plain", f"auto: {blocker}")
    if importlib.util.find_spec("tensorrt") is not None:
        return Target("portable", "plain", "auto: TensorRT is installed here")
    return Target("ort-cpu", "gqa", "auto: the fastest graph on this CPU")


def ort_cpu_blocker(cfg, fuse: bool, dtype: str) -> str | None:
    """Why this build cannot be the GroupQueryAttention graph, or None. The model rules repeat the
    Skip conditions of graph_passes/ort_attention.py (from ORT's kernel), read here from the config
    so that the choice is made before any work rather than after a rewrite that leaves layers out."""
    if not fuse:
        return "no --fuse (the rewrite runs after the fold)"
    if dtype != "fp32":
        return f"--dtype {dtype} (ONNX Runtime's CPU GroupQueryAttention is fp32 only)"
    head = cfg.head_dim
    if head % 8:
        return f"head size {head} (GroupQueryAttention takes multiples of 8)"
    if cfg.pos_embedding == "rope":
        if head % 16:
            return f"head size {head} with rope (GroupQueryAttention rotates multiples of 16)"
        if cfg.rotary_dim not in (None, head):
            return f"partial rotary ({cfg.rotary_dim} of {head} dims; GroupQueryAttention rotates the whole head)"
        scaling = cfg.rope_scaling or {}
        if scaling.get("rope_type") == "longrope" and cfg.max_seq_len > scaling["original_max_position_embeddings"]:
            return (f"longrope past position {scaling['original_max_position_embeddings']} (two frequency sets; "
                    "GroupQueryAttention's cos / sin tables hold one)")
    return None
