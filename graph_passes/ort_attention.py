"""Rewrite each layer's opset-24 Attention + TensorScatter cache writes into one ONNX Runtime
com.microsoft GroupQueryAttention (GQA) op, Q/K/V projections packed into one MatMul.

What export.onnx_export writes per layer with --attention fused (x: the block's input):

    q = Transpose(Reshape(Add(MatMul(x, Wq), bq)))            [B, H, S, D]
    present_k = TensorScatter(key_i, Transpose(Reshape(Add(MatMul(x, Wk), bk))), position, axis=-2)
    present_v = TensorScatter(value_i, ..., position, axis=-2)
    y = Reshape(Transpose(Attention(q, present_k, present_v, mask)))   [B, S, H*D]

and what it becomes (ONNX Runtime's CPU kernel; GenAI's model builder emits the same op):

    qkv = Add(MatMul(x, [Wq|Wk|Wv]), [bq|bk|bv])               [B, S, (H + 2 H_kv) D]
    y, present_k, present_v = GroupQueryAttention(qkv, key_i, value_i, seqlens_k, total_length)

seqlens_k[b] = position[b] + S - 1 (int32) and total_length = max(position) + S, computed once
per graph. GQA writes the S new keys at slots [position[b], position[b] + S) of the cache
and lets query t attend slots <= position[b] + t: exactly the TensorScatter + mask contract.
Bind one OrtValue as both key_i and present_key_i and GQA updates it in place
(`past_present_share_buffer`: it compares the two pointers), as TensorScatter does.

Per 124M decode step (1 thread, profiled) this replaces 12 x (3 Add, 3 Reshape, 4 Transpose,
2 TensorScatter, Attention), ~4.0 ms, by 12 x (Add, GQA), ~1.8 ms; 3 MatMuls become one.

Limits, from ORT's kernel (contrib_ops/cpu/bert/group_query_attention_helper.h):
  * a step with S > 1 that starts after slot 0 (a continued prompt) must have batch 1;
    our runtimes prefill at slot 0, and DecoderSession refuses the other case up front;
  * head size a multiple of 8; fp32 on the CPU (fp16 needs a GPU provider);
  * the mask is not an input: the pass only matches the causal-by-position mask that
    export.onnx_export writes (a LessOrEqual of slots against positions), and a build
    verifies the rewritten graph against the graph before, on the same inputs.
ORT-only: TensorRT's parser has no com.microsoft ops, so builds for TensorRT keep the
portable graph (graph_passes.trt_lint flags this op).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from graph_passes.base import GraphPass, Match, PassContext, Skip, const_value, producer

MS_DOMAIN = "com.microsoft"
TO_BHSD = [0, 2, 1, 3]          # [B, S, H, D] <-> [B, H, S, D]


@dataclass
class GqaMatch(Match):
    attention: gs.Node
    writes: tuple[gs.Node, gs.Node]           # TensorScatter of key_i, of value_i
    inputs_3d: tuple[gs.Tensor, gs.Tensor, gs.Tensor]   # q, k, v before Reshape: [B, S, H*D]
    output_3d: gs.Tensor                       # the Reshape after the Attention: [B, S, H*D]
    heads: int
    kv_heads: int
    scale: float | None
    packed: tuple | None                       # (x, [W], [b]) when q, k, v are Add(MatMul(x, W), b) of one x

    @property
    def detail(self) -> str:
        qkv = "Q/K/V packed into one MatMul" if self.packed else "Q/K/V kept apart"
        return f"Attention + 2 TensorScatter -> GroupQueryAttention ({self.heads} heads, {self.kv_heads} kv), {qkv}"


def _single_consumer(t: gs.Tensor, op: str) -> gs.Node | None:
    return t.outputs[0] if len(t.outputs) == 1 and t.outputs[0].op == op else None


def _perm_is(node: gs.Node | None, perm) -> bool:
    return node is not None and node.op == "Transpose" and list(node.attrs.get("perm", [])) == perm


def _split_heads_input(t: gs.Tensor) -> gs.Tensor | None:
    """x of Transpose(Reshape(x, [B, S, H, D]), perm 0213), the 3-D tensor before the head split."""
    tr = producer(t)
    if not _perm_is(tr, TO_BHSD):
        return None
    rs = producer(tr.inputs[0])
    if rs is None or rs.op != "Reshape" or len(tr.inputs[0].outputs) != 1:
        return None
    return rs.inputs[0]


def _linear(t: gs.Tensor):
    """(x, W, b) of Add(MatMul(x, W), b) with constant 2-D W and 1-D b, else None."""
    add = producer(t)
    if add is None or add.op != "Add" or len(add.outputs[0].outputs) != 1:
        return None
    for mm_in, b_in in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        mm, b = producer(mm_in), const_value(b_in)
        if mm is None or mm.op != "MatMul" or b is None or b.ndim != 1 or len(mm_in.outputs) != 1:
            continue
        w = const_value(mm.inputs[1])
        if w is not None and w.ndim == 2 and w.shape[1] == b.shape[0]:
            return mm.inputs[0], w, b
    return None


def _is_position_mask(t: gs.Tensor, depth: int = 6) -> bool:
    """The mask export.onnx_export writes: (Unsqueeze of) a LessOrEqual of slots against positions."""
    node = producer(t)
    for _ in range(depth):
        if node is None:
            return False
        if node.op == "LessOrEqual":
            return True
        if node.op not in ("Unsqueeze", "Expand", "Reshape"):
            return False
        node = producer(node.inputs[0])
    return False


class OrtGroupQueryAttention(GraphPass):
    name = "ort_gqa"
    summary = "Attention + TensorScatter cache writes -> com.microsoft GroupQueryAttention (ONNX Runtime only)"
    anchors = ("Attention",)

    def __init__(self):
        self._lengths: dict[int, tuple[gs.Tensor, gs.Tensor]] = {}    # per graph: (seqlens_k, total_length)

    def match(self, ctx: PassContext, att: gs.Node) -> GqaMatch | Skip | None:
        if att.domain not in (None, "", "ai.onnx") or len(att.inputs) != 4 or any(
                o.name and (o.outputs or ctx.is_graph_output(o)) for o in att.outputs[1:]):
            return Skip(f"{att.name}: expected Attention(q, k, v, mask) with one used output")
        if att.attrs.get("is_causal", 0) or att.attrs.get("softcap", 0.0) or att.attrs.get("qk_matmul_output_mode", 0):
            return Skip(f"{att.name}: expected is_causal 0, softcap 0, qk_matmul_output_mode 0")
        q, k, v, mask = att.inputs
        if not _is_position_mask(mask):
            return Skip(f"{att.name}: the mask is not export.onnx_export's slot <= position mask")
        writes = (producer(k), producer(v))
        caches = []
        for w in writes:
            if w is None or w.op != "TensorScatter" or w.attrs.get("axis", -2) not in (-2, 2) \
                    or w.attrs.get("mode", "linear") not in ("linear", b"linear"):
                return Skip(f"{att.name}: key / value do not come from a TensorScatter cache write (axis -2)")
            cache, update, pos = w.inputs
            if not (cache in ctx.graph.inputs and pos.name == "position" and ctx.is_graph_output(w.outputs[0])
                    and all(c is att for c in w.outputs[0].outputs)):
                return Skip(f"{att.name}: {w.name} does not write a graph-input cache at `position` into a graph output")
            caches.append((cache, update))
        x3 = (_split_heads_input(q), _split_heads_input(caches[0][1]), _split_heads_input(caches[1][1]))
        if any(x is None for x in x3):
            return Skip(f"{att.name}: q / k / v are not Transpose(Reshape(x)) head splits "
                        "(rotary embeddings between the projection and the split are not matched)")
        out_tr = _single_consumer(att.outputs[0], "Transpose")
        out_rs = _single_consumer(out_tr.outputs[0], "Reshape") if _perm_is(out_tr, TO_BHSD) else None
        if out_rs is None:
            return Skip(f"{att.name}: the output is not merged back by Transpose + Reshape")
        q_shape, cache_shape = q.shape, caches[0][0].shape
        try:
            heads, head_size, kv_heads = int(q_shape[1]), int(q_shape[3]), int(cache_shape[1])
        except (TypeError, ValueError, IndexError):
            return Skip(f"{att.name}: head counts not static in the graph's shapes")
        if head_size % 8 or heads % kv_heads or int(cache_shape[3]) != head_size:
            return Skip(f"{att.name}: ORT's GroupQueryAttention needs head size % 8 == 0 and heads % kv heads == 0 "
                        f"(found head size {head_size}, {heads} heads, {kv_heads} kv heads)")
        if not any(t.name == "input_ids" for t in ctx.graph.inputs):
            return Skip(f"{att.name}: no input_ids graph input to take the step length from")
        lin = [_linear(x) for x in x3]
        packed = None
        if all(lin) and lin[0][0] is lin[1][0] is lin[2][0]:
            packed = (lin[0][0], [w for _, w, _ in lin], [b for _, _, b in lin])
        scale = att.attrs.get("scale")
        return GqaMatch(ctx.layer_name(att), att, writes, x3, out_rs.outputs[0], heads, kv_heads,
                        None if scale is None else float(scale), packed)

    def _step_lengths(self, ctx: PassContext) -> tuple[gs.Tensor, gs.Tensor]:
        """seqlens_k = position + S - 1 (int32 [B]) and total_length = max(position) + S (int32 scalar), once per graph."""
        if id(ctx.graph) in self._lengths:
            return self._lengths[id(ctx.graph)]
        g = ctx.graph
        ids = next(t for t in g.inputs if t.name == "input_ids")
        pos = next(t for t in g.inputs if t.name == "position")

        def node(op, inputs, dtype, attrs=None, shape=None):
            out = gs.Variable(ctx.fresh_name(f"gqa_{op.lower()}"), dtype=dtype, shape=shape)
            g.nodes.append(gs.Node(op=op, name=ctx.fresh_name(f"gqa_{op}"), inputs=inputs, outputs=[out],
                                   attrs=attrs or {}))
            return out
        seq = node("Shape", [ids], np.int64, {"start": 1, "end": 2}, [1])                  # [1]: S
        last = node("Add", [pos, seq], np.int64, shape=pos.shape)                          # position + S
        lens = node("Sub", [last, ctx.const("gqa_one", np.array([1], np.int64))], np.int64, shape=pos.shape)
        seqlens_k = node("Cast", [lens], np.int32, {"to": 6}, pos.shape)                   # int32
        total = node("ReduceMax", [last], np.int64, {"keepdims": 0}, [])
        total = node("Cast", [total], np.int32, {"to": 6}, [])
        self._lengths[id(g)] = (seqlens_k, total)
        return seqlens_k, total

    def rewrite(self, ctx: PassContext, m: GqaMatch) -> None:
        g = ctx.graph
        seqlens_k, total = self._step_lengths(ctx)
        (k_write, v_write) = m.writes
        key_cache, value_cache = k_write.inputs[0], v_write.inputs[0]
        present_k, present_v = k_write.outputs[0], v_write.outputs[0]
        if m.packed is not None:
            x, ws, bs = m.packed
            weight = ctx.const("qkv_weight", np.concatenate(ws, axis=1))
            bias = ctx.const("qkv_bias", np.concatenate(bs))
            width = weight.values.shape[1]
            mm_out = gs.Variable(ctx.fresh_name("qkv_matmul"), dtype=np.float32, shape=[*x.shape[:-1], width]
                                 if x.shape else None)
            qkv = gs.Variable(ctx.fresh_name("qkv"), dtype=np.float32, shape=mm_out.shape)
            g.nodes.append(gs.Node("MatMul", ctx.fresh_name("qkv_MatMul"), inputs=[x, weight], outputs=[mm_out]))
            g.nodes.append(gs.Node("Add", ctx.fresh_name("qkv_Add"), inputs=[mm_out, bias], outputs=[qkv]))
            qkv_inputs = [qkv, gs.Variable.empty(), gs.Variable.empty()]
        else:
            qkv_inputs = list(m.inputs_3d)
        attrs = {"num_heads": m.heads, "kv_num_heads": m.kv_heads}
        if m.scale is not None:
            attrs["scale"] = m.scale
        # the old producers let go of the tensors the new op now writes (cleanup drops them)
        for node in (k_write, v_write, producer(m.output_3d)):
            node.outputs.clear()
        g.nodes.append(gs.Node("GroupQueryAttention", ctx.fresh_name("GroupQueryAttention"), domain=MS_DOMAIN,
                               attrs=attrs, inputs=[*qkv_inputs, key_cache, value_cache, seqlens_k, total],
                               outputs=[m.output_3d, present_k, present_v]))
        if not any(getattr(d, "domain", None) == MS_DOMAIN for d in (g.import_domains or [])):
            import onnx
            domains = list(g.import_domains or [onnx.helper.make_opsetid("", g.opset)])
            g.import_domains = domains + [onnx.helper.make_opsetid(MS_DOMAIN, 1)]
        ctx.model_meta["tapernorm.attention"] = "ort-gqa"
