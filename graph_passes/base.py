"""The pass driver: one pass = one class; the driver lives here, in the base class.

    proto ──load_graph──▶ PassContext(graph, model/node metadata)
                              │  for each pass:  rewrites = pass.find(ctx)   (records only)
                              │                  for r in rewrites: r.apply()  (edits once, at the end)
                              │                  graph.cleanup().toposort()
                              ▼
                          save_graph ──▶ proto (model metadata and surviving node metadata restored)

A subclass implements `find(ctx)`: it walks candidate nodes, checks a pattern
exactly, and returns `Rewrite` records; it never edits the graph while matching
(ONNX Runtime's fusion_base.py does the same). Findings that are not rewrites
(a candidate left alone and why, a lint issue) go to `ctx.note`.

onnx-graphsurgeon drops `metadata_props` on import, so the context keeps them
(model-level, and per node name) and `save_graph` writes them back.
"""
from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from core.errors import UserError

NAME_SCOPES = "pkg.torch.onnx.name_scopes"
CLASS_HIERARCHY = "pkg.torch.onnx.class_hierarchy"


class PassError(UserError):
    """A graph a pass refuses to rewrite; the message is one line meant for the user."""


@dataclass
class Rewrite:
    """One recorded rewrite: what it is (for the log) and the edit itself."""
    label: str                 # the layer or node it concerns, e.g. "blocks.0.ln_1"
    detail: str                # what it does, e.g. "scale -> q_proj, k_proj, v_proj"
    apply: Callable[[], None]


@dataclass
class PassResult:
    name: str
    rewrites: list[tuple[str, str]] = field(default_factory=list)   # (label, detail)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return f"{self.name}: {len(self.rewrites)} rewrite(s)"


class PassContext:
    """The graph being rewritten plus the metadata graphsurgeon does not carry."""

    def __init__(self, proto: onnx.ModelProto):
        self.model_meta = {p.key: p.value for p in proto.metadata_props}
        self.node_meta = {n.name: {p.key: p.value for p in n.metadata_props}
                          for n in proto.graph.node if n.metadata_props}
        self.graph = gs.import_onnx(_with_shapes(proto))
        self.notes: list[str] = []

    def note(self, msg: str) -> None:
        self.notes.append(msg)

    # --- node provenance (torch exporter metadata) -------------------------

    def _scopes(self, node: gs.Node, key: str) -> list[str]:
        raw = self.node_meta.get(node.name, {}).get(key)
        if not raw:
            return []
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            return []
        return [str(v) for v in value] if isinstance(value, (list, tuple)) else []

    def has_provenance(self, node: gs.Node) -> bool:
        return bool(self._scopes(node, CLASS_HIERARCHY))

    def module_class(self, node: gs.Node) -> list[str]:
        """Class names from the outermost module down to the aten op."""
        return self._scopes(node, CLASS_HIERARCHY)

    def layer_name(self, node: gs.Node) -> str:
        """Module path of the node ('blocks.0.ln_1'); the node name when the graph has no provenance.

        name_scopes reads ['', 'model', 'model.blocks.0', 'model.blocks.0.ln_1', 'mul_32']:
        the last entry is the op, the one before it the module, and the
        wrapper's attribute name ('model', 'm', ...) prefixes every path.
        """
        scopes = [s for s in self._scopes(node, NAME_SCOPES) if s]
        if len(scopes) < 2:
            return node.name
        module = scopes[-2]
        wrapper = scopes[0]
        if len(scopes) > 2 and module.startswith(wrapper + "."):
            module = module[len(wrapper) + 1:]
        return module

    def meta_gate(self) -> float | None:
        raw = self.model_meta.get("tapernorm.gate")
        try:
            return None if raw in (None, "", "None") else float(raw)
        except ValueError:
            return None


def _with_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The model with inferred intermediate shapes (the broadcast checks need them); as is if inference fails."""
    try:
        return onnx.shape_inference.infer_shapes(proto)
    except Exception:  # too large (> 2 GB), unknown custom ops: fold only what the given shapes prove
        return proto


def op_counts(proto: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(Counter(n.op_type for n in proto.graph.node).items()))


def load_graph(proto: onnx.ModelProto) -> PassContext:
    return PassContext(proto)


def save_graph(ctx: PassContext, template: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """gs graph -> ModelProto with the model metadata and surviving node metadata put back."""
    proto = gs.export_onnx(ctx.graph)
    if template is not None:
        proto.ir_version = template.ir_version
        proto.producer_name = template.producer_name
        proto.producer_version = template.producer_version
    for k, v in ctx.model_meta.items():
        proto.metadata_props.add(key=k, value=v)
    for node in proto.graph.node:
        for k, v in ctx.node_meta.get(node.name, {}).items():
            node.metadata_props.add(key=k, value=v)
    return proto


class GraphPass:
    """Base class. Subclasses set `name` and `summary` and implement `find`."""

    name: str = ""
    summary: str = ""

    def find(self, ctx: PassContext) -> list[Rewrite]:
        raise NotImplementedError

    def run(self, ctx: PassContext) -> PassResult:
        notes_before = len(ctx.notes)
        rewrites = self.find(ctx)          # record every match first ...
        for r in rewrites:                 # ... then edit the graph once
            r.apply()
        ctx.graph.cleanup().toposort()
        return PassResult(self.name, [(r.label, r.detail) for r in rewrites], ctx.notes[notes_before:])


# --- helpers shared by the passes ---------------------------------------------

def const_value(t: gs.Tensor) -> np.ndarray | None:
    """The value of a constant tensor (initializer or Constant node output), else None."""
    if isinstance(t, gs.Constant):
        return np.asarray(t.values)
    if isinstance(t, gs.Variable) and len(t.inputs) == 1 and t.inputs[0].op == "Constant":
        node = t.inputs[0]
        value = node.attrs.get("value")
        if isinstance(value, gs.Constant):
            return np.asarray(value.values)
    return None


def producer(t: gs.Tensor) -> gs.Node | None:
    return t.inputs[0] if len(t.inputs) == 1 else None


def is_graph_output(graph: gs.Graph, t: gs.Tensor) -> bool:
    return any(o is t for o in graph.outputs)


def channel_vector(value: np.ndarray | None) -> np.ndarray | None:
    """A per-channel vector from a value that broadcasts along the LAST axis only.

    Accepts shapes [d], [1, ..., 1, d] (and scalars, as length-1 vectors);
    rejects [d, 1] and anything else that would scale another axis.
    """
    if value is None or value.dtype.kind != "f":
        return None
    if value.ndim == 0:
        return value.reshape(1)
    if any(s != 1 for s in value.shape[:-1]):
        return None
    return value.reshape(-1)


_counter = [0]


def fresh_name(graph: gs.Graph, base: str) -> str:
    names = set(graph.tensors().keys())
    while True:
        _counter[0] += 1
        name = f"{base}__folded{_counter[0]}"
        if name not in names:
            return name
