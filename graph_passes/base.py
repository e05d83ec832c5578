"""The pass driver: one pass = one class; the walk lives here, in the base class.

    proto ──load_graph──▶ PassContext(graph, model/node metadata, name counter)
                              │  for each pass, for every graph (main, then If/Loop/Scan bodies):
                              │      for node of an anchor op type:  match(scope, node) -> Match | Skip | None
                              │  then, once every match is recorded:  rewrite(scope, match)
                              │  graph.cleanup().toposort()   (subgraphs included)
                              ▼
                          save_graph ──▶ proto (model metadata and surviving node metadata restored)

A subclass names its `anchors` (op types) and implements `match` (check a
pattern exactly; never edit the graph) and `rewrite` (apply one recorded
match). ONNX Runtime's transformers optimizer (fusion_base.py) works the same
way. A match is a typed object (a `Match` subclass of the pass's own); a
candidate left alone is a `Skip` naming the node and why, and becomes a typed
`Finding` in the pass's result; nothing is reported as a parsed string.

Names of new tensors and nodes come from a per-graph counter (`ctx.fresh_name`),
so the same input always gives the same output file.

onnx-graphsurgeon drops `metadata_props` on import, so the context keeps them
(model-level, and per node name, subgraphs included) and `save_graph` writes them back.

A graph emitted from a checkpoint (export/emit.py) comes with its large weights unread: a dict
initializer name -> graph_passes.lazy.Lazy. The context puts each Lazy in its constant, `const_value`
hands it out as it is, and the folds record their arithmetic on it (graph_passes/lazy.py);
`lazy_weights` gives the Lazies of the rewritten graph, which the build computes when it writes them.
"""
from __future__ import annotations

import ast
import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar, Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from core.errors import UserError
from graph_passes.lazy import Lazy, put, stored_lazy

NAME_SCOPES = "pkg.torch.onnx.name_scopes"
CLASS_HIERARCHY = "pkg.torch.onnx.class_hierarchy"
SUBGRAPH_OPS = ("If", "Loop", "Scan")


class PassError(UserError):
    """A graph a pass refuses to rewrite; the message is one line meant for the user."""


# --- what a pass reports -----------------------------------------------------------------------

@dataclass(frozen=True)
class Folded:
    """One rewrite, for the log: where ('blocks.0.ln_1') and what ('scale -> q_proj, k_proj')."""
    where: str
    detail: str


@dataclass(frozen=True)
class Finding:
    """A candidate a pass left alone (kind 'skipped') or a lint issue (kind 'lint'): one line each."""
    pass_name: str
    where: str                 # the layer or node, e.g. 'model.layers.0.input_layernorm' or 'node_Mul_12'
    why: str                   # what stopped it, e.g. 'node_Relu_3 is a Relu, not a MatMul/Gemm'
    kind: str = "skipped"      # 'skipped' | 'lint'

    def __str__(self) -> str:
        return f"{self.where}: {'left unfolded: ' if self.kind == 'skipped' else ''}{self.why}"


@dataclass
class PassResult:
    name: str
    folded: list[Folded] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def rewrites(self) -> list[tuple[str, str]]:
        """(where, detail) per rewrite."""
        return [(f.where, f.detail) for f in self.folded]

    @property
    def notes(self) -> list[str]:
        """One line per finding."""
        return [str(f) for f in self.findings]

    @property
    def lint(self) -> list[Finding]:
        return [f for f in self.findings if f.kind == "lint"]

    @property
    def skipped(self) -> list[Finding]:
        return [f for f in self.findings if f.kind == "skipped"]

    def summary(self) -> str:
        return f"{self.name}: {len(self.folded)} folded, {len(self.skipped)} skipped"


@dataclass
class Match:
    """Base of a pass's typed matches. `where` names the layer or node; `detail` says what the rewrite does."""
    where: str

    @property
    def detail(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class Skip:
    """match()'s answer for a candidate that must be left alone, and why (one line)."""
    why: str


# --- the context -------------------------------------------------------------------------------

@dataclass
class _Naming:
    """The per-model name counter: the same input always gets the same new names."""
    count: int = 0
    used: set[str] | None = None            # every tensor and node name, read on first use


class PassContext:
    """The graph being rewritten plus what graphsurgeon does not carry.

    One context per model. `scoped(graph)` gives a view of the same context on
    one subgraph: the metadata, the name counter and the findings are shared;
    `graph` is the (sub)graph whose nodes are being matched, so that "is a graph
    output" and new nodes refer to the right scope.
    """

    def __init__(self, proto: onnx.ModelProto, lazy: dict[str, Lazy] | None = None):
        self.model_meta = {p.key: p.value for p in proto.metadata_props}
        self.node_meta: dict[str, dict[str, str]] = {}
        for node in all_nodes(proto.graph):
            if node.metadata_props:
                self.node_meta.setdefault(node.name, {p.key: p.value for p in node.metadata_props})
        self.root = gs.import_onnx(_with_shapes(proto))
        self.graph = self.root
        if lazy:
            for g in self.graphs():
                for t in g.tensors().values():
                    if isinstance(t, gs.Constant) and t.name in lazy:
                        put(t, lazy[t.name])
        self._naming = _Naming()            # shared by every scoped view

    def scoped(self, graph: gs.Graph) -> "PassContext":
        view = copy.copy(self)
        view.graph, view._owned = graph, None
        return view

    def owns(self, node: gs.Node) -> bool:
        """Whether `node` belongs to this scope's graph (not to a subgraph reading an outer tensor)."""
        if getattr(self, "_owned", None) is None:
            self._owned = {id(n) for n in self.graph.nodes}
        return id(node) in self._owned

    def graphs(self) -> Iterator[gs.Graph]:
        """The main graph, then every If / Loop / Scan body, depth first, in node order."""
        def walk(g: gs.Graph):
            yield g
            for node in g.nodes:
                for value in node.attrs.values():
                    if isinstance(value, gs.Graph):
                        yield from walk(value)
        yield from walk(self.root)

    def fresh_name(self, base: str) -> str:
        """A tensor or node name not used anywhere in the model: base__folded<n>, n from a per-model counter."""
        naming = self._naming
        if naming.used is None:
            naming.used = {name for g in self.graphs() for name in g.tensors()} | \
                          {n.name for g in self.graphs() for n in g.nodes}
        while True:
            naming.count += 1
            name = f"{base}__folded{naming.count}"
            if name not in naming.used:
                naming.used.add(name)
                return name

    def next_stage(self, template: onnx.ModelProto) -> None:
        """Begin a later stage of passes on this loaded graph as on the graph saved (save_graph(self, template))
        and loaded anew: onnx's shape inference runs again, so that the tensors the earlier passes made get the
        shapes it finds (a merged [B, S, None] becomes [B, S, H * D]), and new names are numbered from 1 again
        (still avoiding every name in the graph). The stage sees, and its graph keeps, what a second load gave:
        export's quantization after its folds writes the graph it wrote when each stage loaded its own. It
        costs one export and one inference, not a second graphsurgeon import."""
        from onnx_graphsurgeon.importers.onnx_importer import OnnxImporter
        inferred = _with_shapes(save_graph(self, template)).graph
        tensors = self.root.tensors()
        for info in [*inferred.value_info, *inferred.output]:
            t = tensors.get(info.name)
            if isinstance(t, gs.Variable):
                found = OnnxImporter.import_tensor(info)
                t.dtype, t.shape = found.dtype, found.shape
        self._naming.count, self._naming.used = 0, None

    def const(self, base: str, value) -> gs.Constant:
        """A NEW constant (never an edit of a shared one): an array, or a Lazy computed when written."""
        return gs.Constant(self.fresh_name(base), value if isinstance(value, Lazy) else np.ascontiguousarray(value))

    def lazy_weights(self) -> dict[str, Lazy]:
        """The constants of the (rewritten) graph whose values are computed when written, by name."""
        return {t.name: stored_lazy(t) for g in self.graphs() for t in g.tensors().values()
                if isinstance(t, gs.Constant) and stored_lazy(t) is not None}

    def is_graph_output(self, t: gs.Tensor) -> bool:
        return any(o is t for o in self.graph.outputs)

    def import_domain(self, domain: str, version: int = 1) -> None:
        """Declare `domain` in the model's opset imports (once): a rewrite that writes its ops
        (com.microsoft: MatMulNBits, GroupQueryAttention) calls this."""
        g = self.root
        if not any(getattr(d, "domain", None) == domain for d in (g.import_domains or [])):
            domains = list(g.import_domains or [onnx.helper.make_opsetid("", g.opset)])
            g.import_domains = domains + [onnx.helper.make_opsetid(domain, version)]

    def cleanup(self) -> None:
        self.root.cleanup(recurse_subgraphs=True).toposort(recurse_subgraphs=True)

    # --- node provenance (torch exporter metadata) -------------------------

    def scopes_of(self, node: gs.Node, key: str) -> list[str]:
        return scopes(self.node_meta.get(node.name, {}), key)

    def has_provenance(self, node: gs.Node) -> bool:
        return bool(self.scopes_of(node, CLASS_HIERARCHY))

    def module_class(self, node: gs.Node) -> list[str]:
        """Class names from the outermost module down to the aten op."""
        return self.scopes_of(node, CLASS_HIERARCHY)

    def layer_name(self, node: gs.Node) -> str:
        """Module path of the node ('blocks.0.ln_1'); the node name when the graph has no provenance."""
        return layer_name_of(node.name, self.node_meta.get(node.name, {}))

    def weight_bytes(self) -> int:
        """Bytes of the main graph's constants as stored (as core.onnx_writer.initializer_bytes counts the
        initializers of the graph save_graph would write), values computed when written left unread."""
        total = 0
        for t in self.root.tensors().values():
            if isinstance(t, gs.Constant):
                lazy = stored_lazy(t)
                value = lazy if lazy is not None else t.values
                size = int(np.prod(value.shape, dtype=np.int64))
                dtype = np.dtype(value.dtype)
                total += -(-size // 2) if dtype.name in PACKED_DTYPES else size * dtype.itemsize
        return total

    def meta_gate(self) -> float | None:
        raw = self.model_meta.get("tapernorm.gate")
        try:
            return None if raw in (None, "", "None") else float(raw)
        except ValueError:
            return None


PACKED_DTYPES = ("int4", "uint4")        # two values a byte as stored (numpy holds one a byte)


def scopes(meta: dict[str, str], key: str) -> list[str]:
    """A node's provenance list under `key` (the torch exporter's metadata: CLASS_HIERARCHY, NAME_SCOPES)."""
    raw = meta.get(key)
    if not raw:
        return []
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return []
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else []


def layer_name_of(name: str, meta: dict[str, str]) -> str:
    """Module path of a node ('blocks.0.ln_1') from its metadata `meta`; `name` (the node's) without provenance.

    name_scopes reads ['', 'model', 'model.blocks.0', 'model.blocks.0.ln_1', 'mul_32']:
    the last entry is the op, the one before it the module, and the
    wrapper's attribute name ('model', 'm', ...) prefixes every path.
    """
    names = [s for s in scopes(meta, NAME_SCOPES) if s]
    if len(names) < 2:
        return name
    module = names[-2]
    wrapper = names[0]
    if len(names) > 2 and module.startswith(wrapper + "."):
        module = module[len(wrapper) + 1:]
    return module


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The graph's nodes and, depth first, those of their subgraphs (If / Loop / Scan bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attr.g)
            for g in attr.graphs:
                yield from all_nodes(g)


def _with_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The model with inferred intermediate shapes (the broadcast checks need them); as is if inference fails."""
    try:
        return onnx.shape_inference.infer_shapes(proto)
    except Exception:  # too large (> 2 GB), unknown custom ops: fold only what the given shapes prove
        return proto


def op_counts(proto: onnx.ModelProto) -> dict[str, int]:
    """Op type -> count over the main graph and every subgraph."""
    return dict(sorted(Counter(n.op_type for n in all_nodes(proto.graph)).items()))


def load_graph(proto: onnx.ModelProto, lazy: dict[str, Lazy] | None = None) -> PassContext:
    return PassContext(proto, lazy)


def save_graph(ctx: PassContext, template: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """gs graph -> ModelProto with the model metadata and surviving node metadata put back."""
    proto = gs.export_onnx(ctx.root)
    if template is not None:
        proto.ir_version = template.ir_version
        proto.producer_name = template.producer_name
        proto.producer_version = template.producer_version
        _keep_declared_io(proto.graph, template.graph)
    for k, v in ctx.model_meta.items():
        proto.metadata_props.add(key=k, value=v)
    for node in all_nodes(proto.graph):
        for k, v in ctx.node_meta.get(node.name, {}).items():
            node.metadata_props.add(key=k, value=v)
    return proto


def _keep_declared_io(graph: onnx.GraphProto, template: onnx.GraphProto) -> None:
    """The graph's inputs and outputs as the template declared them: shape inference may have
    refined a dynamic axis (batch -> 1) in a declaration, which would change the interface."""
    declared = {v.name: v for v in list(template.input) + list(template.output)}
    for v in list(graph.input) + list(graph.output):
        if v.name in declared:
            v.CopyFrom(declared[v.name])


# --- the pass base class -----------------------------------------------------------------------

class GraphPass:
    """Base class: owns the walk. Subclasses set `name`, `summary`, `anchors` and implement
    `match(ctx, node)` (no edits) and `rewrite(ctx, match)` (one edit)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    anchors: ClassVar[tuple[str, ...]] = ()        # op types whose nodes are candidates

    def match(self, ctx: PassContext, node: gs.Node) -> Match | Skip | None:
        """A Match to rewrite, a Skip (a candidate left alone, and why), or None (not a candidate)."""
        raise NotImplementedError

    def rewrite(self, ctx: PassContext, match: Match) -> None:
        raise NotImplementedError

    def prepare(self, ctx: PassContext) -> None:
        """Checks over the whole model before the walk (e.g. refuse a graph); nothing by default."""

    def run(self, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        self.prepare(ctx)
        recorded: list[tuple[PassContext, Match]] = []
        for graph in list(ctx.graphs()):            # record every match first ...
            scope = ctx.scoped(graph)
            for node in list(graph.nodes):
                if node.op not in self.anchors:
                    continue
                found = self.match(scope, node)
                if isinstance(found, Skip):
                    result.findings.append(Finding(self.name, scope.layer_name(node), found.why))
                elif found is not None:
                    recorded.append((scope, found))
        for scope, m in recorded:                   # ... then edit the graph once
            self.rewrite(scope, m)
            result.folded.append(Folded(m.where, m.detail))
        if recorded:
            ctx.cleanup()
        return result


# --- helpers shared by the passes ---------------------------------------------

def const_value(t: gs.Tensor) -> np.ndarray | Lazy | None:
    """The value of a constant tensor (initializer or Constant node output), else None. A weight
    computed when written comes as its Lazy, unread (gs's `values` would load and keep it)."""
    if isinstance(t, gs.Constant):
        lazy = stored_lazy(t)
        return lazy if lazy is not None else np.asarray(t.values)
    if isinstance(t, gs.Variable) and len(t.inputs) == 1 and t.inputs[0].op == "Constant":
        node = t.inputs[0]
        value = node.attrs.get("value")
        if isinstance(value, gs.Constant):
            return np.asarray(value.values)
    return None


def producer(t: gs.Tensor) -> gs.Node | None:
    return t.inputs[0] if len(t.inputs) == 1 else None


def is_float(dtype) -> bool:
    """A floating-point element type, bfloat16 (ml_dtypes: numpy kind 'V') included."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name == "bfloat16"


def channel_vector(value: np.ndarray | None) -> np.ndarray | None:
    """A per-channel vector from a value that broadcasts along the LAST axis only.

    Accepts shapes [d], [1, ..., 1, d] (and scalars, as length-1 vectors);
    rejects [d, 1] and anything else that would scale another axis.
    """
    if value is None or not is_float(value.dtype):
        return None
    if value.ndim == 0:
        return value.reshape(1)
    if any(s != 1 for s in value.shape[:-1]):
        return None
    return value.reshape(-1)


def static_last_dim(t: gs.Tensor) -> int | None:
    shape = t.shape
    if not shape:
        return None
    last = shape[-1]
    return int(last) if isinstance(last, (int, np.integer)) and last >= 0 else None
