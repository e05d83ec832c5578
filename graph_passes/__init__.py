"""ONNX graph passes: fold TaperNorm / norm / DyT scales into linear weights; TensorRT lint.

    python -m graph_passes IN.onnx -o OUT.onnx [--passes a,b,...] [--strict]

graph_passes depends on onnx, onnx-graphsurgeon and numpy only (never torch).
"""
from graph_passes.base import Finding, Folded, GraphPass, Match, PassError, PassResult, Skip
from graph_passes.registry import DEFAULT_PASSES, PASSES, passes_for, run_passes

__all__ = ["GraphPass", "Match", "Skip", "Folded", "Finding", "PassError", "PassResult", "PASSES", "DEFAULT_PASSES", "passes_for", "run_passes"]
