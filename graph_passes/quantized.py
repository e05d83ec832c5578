"""Weight-only quantization as graph rewrites (export/quantize.py picks the options and the quantizer).

    quantize              MatMul(x, W) -> MatMulNBits(x, blocks of W); the token embedding's
                          Gather(E, ids) -> GatherBlockQuantized(blocks of E, ids)
    tied_table            the token embedding reads the LM head's MatMulNBits blocks: one table
    embedding_like_head   an untied fp32 embedding reads blocks quantized like an int8 head
    mnb_bias              Sum(x, MatMulNBits(h), b) -> Add(x, MatMulNBits(h, bias=b))

They are not in the registry: they need what only the quantizing caller knows (the quantizer that
makes the blocks and which bits each layer gets; the tie, found on the float graph before `quantize`
changed both tables), and none of them has anything to do on a float graph. The blocks of a weight
computed when written (graph_passes/lazy.py) are Lazies too: the quantizer runs on each matrix when
it is written, once for all the tensors it makes.

A table read as rows of MatMulNBits blocks: the head's MatMulNBits packs W [d, V] as V rows
of d values in blocks along d, which is E [V, d] quantized along d, symmetric (zero point
2^(bits-1) for MatMulNBits and GatherBlockQuantized alike), as GenAI's model builder stores
a tied table. The values read are those of two separate tables.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from core.contract import INPUT_IDS, LOGITS
from graph_passes.base import GraphPass, Match, PassContext, Skip, const_value, is_float, producer
from graph_passes.lazy import Lazy, digest, parts, same_values, transposed

UNTIED = "untied: the LM head's weight is not the token embedding's table (or a fold scaled one of them)"


# --- the float graph, read before quantization ---------------------------------------------------

def head_matmul(proto: onnx.ModelProto) -> onnx.NodeProto | None:
    """The LM head: the MatMul with a constant weight the logits come from (through at most a few
    single-path ops such as a bias Add or a Reshape), or None."""
    inits = {i.name for i in proto.graph.initializer}
    made_by = {o: n for n in proto.graph.node for o in n.output}
    name = LOGITS
    for _ in range(8):
        node = made_by.get(name)
        if node is None:
            return None
        if node.op_type == "MatMul" and node.input[1] in inits:
            return node
        name = next((i for i in node.input if i and i not in inits), "")
    return None


@dataclass(frozen=True)
class Tie:
    """Output names of the token embedding and of the LM head whose weight is its table transposed."""
    embedding: str
    head: str


def find_tie(ctx: PassContext) -> Tie | None:
    """The tie when the token embedding's table E [V, d] equals the LM head's weight transposed (a
    tied head no fold touched), else None. Read on the float graph: `quantize` rewrites both."""
    head = head_node(ctx)
    emb = next((n for n in ctx.graph.nodes if n.op == "Gather" and is_token_embedding(n)), None)
    if head is None or emb is None or emb.attrs.get("axis", 0) != 0:
        return None
    w, e = const_value(head.inputs[1]), const_value(emb.inputs[0])
    if e is None or tuple(w.shape)[::-1] != tuple(e.shape) or not same_values(transposed(w), e):
        return None
    return Tie(emb.outputs[0].name, head.outputs[0].name)


def head_node(ctx: PassContext) -> gs.Node | None:
    """The LM head MatMul (head_matmul, on the graph being rewritten)."""
    t = next((o for o in ctx.graph.outputs if o.name == LOGITS), None)
    for _ in range(8):
        node = producer(t) if t is not None else None
        if node is None:
            return None
        if node.op == "MatMul" and const_value(node.inputs[1]) is not None:
            return node
        t = next((i for i in node.inputs if const_value(i) is None), None)
    return None


def is_token_embedding(node: gs.Node) -> bool:
    return node.op in ("Gather", "GatherBlockQuantized") and len(node.inputs) > 1 and node.inputs[1].name == INPUT_IDS


# --- quantize: the weights into blocks --------------------------------------------------------------

class Quantizer:
    """What the `quantize` pass asks of the caller's quantizer (export/quantize.py): the quantized node
    of a weight and the tensors it reads, and those tensors' values."""

    def layout(self, op: str, shape: tuple, bits: int) -> tuple[str, dict, list[tuple[str, tuple, object]]]:
        """For a weight of `shape` read by `op` (MatMul: W [K, N]; Gather: a table [V, d]): the quantized op,
        its attributes, and (name suffix, shape, dtype) of each tensor it reads after its data input."""
        raise NotImplementedError

    def blocks(self, op: str, w: np.ndarray, bits: int, where: str = "") -> list[np.ndarray]:
        """Those tensors' values for the weight w, in layout's order (`where`: the layer, for a refusal)."""
        raise NotImplementedError


@dataclass
class QuantizeMatch(Match):
    node: gs.Node                  # the MatMul or the token embedding's Gather
    bits: int

    @property
    def detail(self) -> str:
        return f"{self.node.op} -> int{self.bits} blocks"


class QuantizeWeights(GraphPass):
    name = "quantize"
    summary = "constant-weight MatMuls -> MatMulNBits, the token embedding -> GatherBlockQuantized (weight-only)"
    anchors = ("MatMul", "Gather")

    # Pattern (`bits_of(layer, node)` says each weight's bits, None: left float; the quantizer makes the blocks):
    #
    #     x ──▶ MatMul(x, W) ──▶ y          W: a constant [K, N]
    #   ==>
    #     x ──▶ MatMulNBits(x, W_Q<bits>, W_scales[, W_zero_points]) ──▶ y
    #
    #     input_ids ──▶ Gather(E, axis 0) ──▶ e          E: a constant [V, d]
    #   ==>
    #     input_ids ──▶ GatherBlockQuantized(E_Q4, input_ids, E_scales) ──▶ e
    #
    # Left alone: a MatMul of two activations (attention), a weight that is not 2-D float, a Gather that
    # is not the token embedding (the position table: one row a token), a layer bits_of leaves float.

    def __init__(self, quantizer: Quantizer, bits_of: Callable[[str, gs.Node], int | None]):
        self.quantizer, self.bits_of = quantizer, bits_of

    def match(self, ctx: PassContext, node: gs.Node) -> QuantizeMatch | Skip | None:
        if node.op == "Gather" and (not is_token_embedding(node) or node.attrs.get("axis", 0) != 0):
            return None
        w = const_value(node.inputs[0 if node.op == "Gather" else 1])
        if w is None or (node.op == "MatMul" and const_value(node.inputs[0]) is not None):
            return None
        if w.ndim != 2 or not is_float(w.dtype):
            return Skip(f"{node.name}: a weight of {w.ndim} dims, {w.dtype}: left float")
        bits = self.bits_of(ctx.layer_name(node), node)
        return None if bits is None else QuantizeMatch(ctx.layer_name(node), node, bits)

    def rewrite(self, ctx: PassContext, m: QuantizeMatch) -> None:
        node, q = m.node, self.quantizer
        source = node.inputs[0 if node.op == "Gather" else 1]
        w = const_value(source)
        op, attrs, specs = q.layout(node.op, tuple(w.shape), m.bits)
        if not isinstance(w, Lazy):       # a weight in memory: its blocks too are computed when written
            w = Lazy(w.shape, w.dtype, lambda a=np.asarray(w): a, ("array", digest(np.asarray(w))))
        values = parts(lambda: q.blocks(node.op, w.load(), m.bits, m.where), [(s, d) for _, s, d in specs],
                       w.key + ("quantized", node.op, m.bits), w.group)
        tensors = [gs.Constant(f"{source.name}{suffix}", v) for (suffix, _, _), v in zip(specs, values)]
        data = node.inputs[1] if node.op == "Gather" else node.inputs[0]
        inputs = [tensors[0], data, *tensors[1:]] if node.op == "Gather" else [data, *tensors]
        name = f"{node.name}_Q{m.bits}"
        if node.name in ctx.node_meta:          # the layer keeps its name in reports and --int8-layers
            ctx.node_meta[name] = ctx.node_meta[node.name]
        out = node.outputs[0]
        node.outputs.clear()                    # the float node lets go of its output; cleanup drops it
        ctx.graph.nodes.append(gs.Node(op, name, domain="com.microsoft", attrs=attrs, inputs=inputs, outputs=[out]))
        ctx.import_domain("com.microsoft")


# --- tied_table and embedding_like_head: the token embedding read from blocks ------------------------

@dataclass
class BlocksTableMatch(Match):
    """The token embedding to be read from MatMulNBits-format blocks."""
    embedding: gs.Node
    data: gs.Tensor               # [V, d / block, blob]
    scales: gs.Tensor
    rows: int                     # V
    bits: int
    block: int
    what: str                     # the detail, e.g. "stored once: ..."

    @property
    def detail(self) -> str:
        return self.what


class TableFromBlocks(GraphPass):
    """Base of the two passes that make the token embedding a GatherBlockQuantized over blocks."""

    def rewrite(self, ctx: PassContext, m: BlocksTableMatch) -> None:
        """GatherBlockQuantized(Reshape(data [V, d/block, blob] -> [V, -1]), ids, Reshape(scales -> [V, d/block]))."""
        shape = ctx.const(f"{m.data.name}_rows_shape", np.array([m.rows, -1], np.int64))
        table, scales = (gs.Variable(ctx.fresh_name(f"{t.name}_rows")) for t in (m.data, m.scales))
        emb, out = m.embedding, m.embedding.outputs[0]
        emb.outputs.clear()                # the old embedding lets go of its output; cleanup drops it and its tables
        ctx.graph.nodes += [
            gs.Node("Reshape", ctx.fresh_name(f"{emb.name}_table"), inputs=[m.data, shape], outputs=[table]),
            gs.Node("Reshape", ctx.fresh_name(f"{emb.name}_scales"), inputs=[m.scales, shape], outputs=[scales]),
            gs.Node("GatherBlockQuantized", ctx.fresh_name(f"{emb.name}_blocks"), domain="com.microsoft",
                    attrs={"bits": m.bits, "block_size": m.block, "gather_axis": 0, "quantize_axis": 1},
                    inputs=[table, emb.inputs[1], scales], outputs=[out])]


class ShareTiedTable(TableFromBlocks):
    name = "tied_table"
    summary = "a tied embedding reads the quantized LM head's blocks (GatherBlockQuantized): the table stored once"
    anchors = ("Gather", "GatherBlockQuantized")

    # Pattern (the tie found on the float graph: find_tie):
    #
    #     input_ids ──▶ Gather(E) | GatherBlockQuantized(E blocks) ──▶ emb        E [V, d] = W^T
    #     h ──▶ MatMulNBits(W blocks [V, d/block, blob], scales, no zero points) ──▶ logits
    #   ==>
    #     input_ids ──▶ GatherBlockQuantized(Reshape(W blocks), Reshape(scales)) ──▶ emb
    #
    # Left alone: no tie, a head left a MatMul (--head fp32), a head with zero points (hqq),
    # d_model not a multiple of the block size.

    def __init__(self, tie: Tie | None):
        self.tie = tie

    def match(self, ctx: PassContext, node: gs.Node) -> BlocksTableMatch | Skip | None:
        if not is_token_embedding(node):
            return None
        if self.tie is None:
            return Skip(UNTIED)
        if node.outputs[0].name != self.tie.embedding:
            return None
        head = producer(ctx.graph.tensors().get(self.tie.head))
        if head is None or head.op != "MatMulNBits":
            return Skip(f"stored twice: the LM head is a {getattr(head, 'op', None)} (not quantized), "
                        f"the embedding a {node.op}")
        if len(head.inputs) > 3 and head.inputs[3].name:
            return Skip("stored twice: the LM head's blocks have zero points (asymmetric); "
                        "the embedding keeps its own table")
        k, block, bits = head.attrs["K"], head.attrs["block_size"], head.attrs["bits"]
        if k % block:
            return Skip(f"stored twice: d_model {k} is not a multiple of the block size {block}")
        data, scales = head.inputs[1], head.inputs[2]
        return BlocksTableMatch(ctx.layer_name(node), node, data, scales, head.attrs["N"], bits, block,
                                f"stored once: the token embedding reads the LM head's int{bits} blocks "
                                "(GatherBlockQuantized)")


class EmbeddingLikeHead(TableFromBlocks):
    name = "embedding_like_head"
    summary = "an untied fp32 embedding reads its table quantized as the head's MatMulNBits blocks (int8 head)"
    anchors = ("Gather",)

    # Pattern (`blocks_of` quantizes E^T as a MatMul weight: ORT's quantizer has no int8 Gather):
    #
    #     input_ids ──▶ Gather(E, axis 0) ──▶ emb        E: a constant [V, d], d a multiple of the block
    #   ==>
    #     input_ids ──▶ GatherBlockQuantized(Reshape(E_Q<bits>), Reshape(E_scales)) ──▶ emb
    #
    # Left alone: a table that is not 2-D or whose width is not a multiple of the block size.

    def __init__(self, blocks_of: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], bits: int, block: int):
        self.blocks_of, self.bits, self.block = blocks_of, bits, block

    def match(self, ctx: PassContext, node: gs.Node) -> BlocksTableMatch | Skip | None:
        table = const_value(node.inputs[0]) if is_token_embedding(node) and node.attrs.get("axis", 0) == 0 else None
        if table is None:
            return None
        if table.ndim != 2 or table.shape[1] % self.block:
            return Skip(f"token embedding kept fp32: its width is not a multiple of the block size {self.block}")
        if isinstance(table, Lazy):                   # computed when written, once for both tensors
            v, k_blocks = table.shape[0], table.shape[1] // self.block
            data, scales = parts(lambda: self.blocks_of(table.load()),
                                 [((v, k_blocks, self.block * self.bits // 8), np.uint8), ((v, k_blocks), np.float32)],
                                 table.key + ("head blocks", self.bits, self.block), table.group)
        else:
            data, scales = self.blocks_of(table)      # new constants, not yet in the graph
        source = node.inputs[0].name
        # ONNX Runtime's names for a quantizer's outputs (what its own quantizer calls this table's blocks)
        return BlocksTableMatch(ctx.layer_name(node), node, gs.Constant(f"{source}_Q{self.bits}", data),
                                gs.Constant(f"{source}_scales", scales), table.shape[0], self.bits, self.block,
                                f"token embedding int{self.bits} like the head (GatherBlockQuantized)")


# --- mnb_bias -------------------------------------------------------------------------------------

@dataclass
class BiasMatch(Match):
    sum: gs.Node
    matmul: gs.Node               # the MatMulNBits
    bias: gs.Constant             # [N]

    @property
    def detail(self) -> str:
        return "bias moved from the residual Sum into MatMulNBits"


class BiasIntoMatMulNBits(GraphPass):
    name = "mnb_bias"
    summary = "undo ort_bias_sum where the weight is quantized: the bias into MatMulNBits' own epilogue"
    anchors = ("Sum",)

    # Pattern (the Sum ort_bias_sum writes; MatMulNBits adds a bias in its epilogue, input 5, as
    # ONNX Runtime's own MatMulNBits + Add fusion does: the logits equal, bit for bit, those of
    # the quantized graph the Sums would not have changed):
    #
    #     Sum(x, MatMulNBits(h), b) ──▶ y          b: a constant [N]; the MatMulNBits output read only here
    #   ==>
    #     Add(x, MatMulNBits(h, bias=b)) ──▶ y
    #
    # Left alone: a MatMul left fp32, a MatMulNBits output read elsewhere, one with a bias already,
    # a third input that is not a constant [N].

    def match(self, ctx: PassContext, node: gs.Node) -> BiasMatch | Skip | None:
        if len(node.inputs) != 3:
            return None
        _, y, b = node.inputs
        mm = producer(y)
        if mm is None or mm.op not in ("MatMul", "MatMulNBits"):
            return None
        if mm.op == "MatMul":
            return Skip(f"{mm.name} is a MatMul (not quantized): its bias stays in the Sum")
        if len(y.outputs) != 1 or ctx.is_graph_output(y):
            return Skip(f"{mm.name}'s output is read elsewhere too: the bias stays in the Sum")
        if len(mm.inputs) > 5:
            return Skip(f"{mm.name} has a bias input already")
        if not isinstance(b, gs.Constant) or list(b.shape) != [mm.attrs["N"]]:
            return Skip(f"{node.name}: its third input is not a constant bias [{mm.attrs['N']}]")
        return BiasMatch(ctx.layer_name(mm), node, mm, b)

    def rewrite(self, ctx: PassContext, m: BiasMatch) -> None:
        x, y, _ = m.sum.inputs
        m.matmul.inputs.extend([gs.Variable.empty() for _ in range(5 - len(m.matmul.inputs))] + [m.bias])
        out = m.sum.outputs[0]
        m.sum.outputs.clear()               # the Sum lets go of y; cleanup drops it
        ctx.graph.nodes.append(gs.Node("Add", ctx.fresh_name("residual_Add"), inputs=[x, y], outputs=[out]))
