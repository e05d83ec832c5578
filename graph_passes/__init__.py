"""ONNX graph passes: fold TaperNorm / norm / DyT scales into linear weights; TensorRT lint.

    python -m graph_passes IN.onnx -o OUT.onnx [--passes a,b,...] [--strict]

graph_passes depends on onnx, onnx-graphsurgeon and numpy only (never torch).
"""
import importlib

_FROM = {**dict.fromkeys(("GraphPass", "Match", "Skip", "Folded", "Finding", "PassError", "PassResult"),
                         "graph_passes.base"),
         **dict.fromkeys(("PASSES", "DEFAULT_PASSES", "passes_for", "run_passes", "run_passes_in"), "graph_passes.registry")}
__all__ = list(_FROM)


def __getattr__(name: str):
    """The package's names, loaded on first use (PEP 562) rather than on import: `python -m graph_passes`
    imports this package before its __main__ can guard start-up against a Ctrl-C, and onnx takes a while."""
    if name in _FROM:
        return getattr(importlib.import_module(_FROM[name]), name)
    raise AttributeError(f"module 'graph_passes' has no attribute {name!r}")
