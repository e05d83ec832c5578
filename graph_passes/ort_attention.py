"""Rewrite each layer's opset-24 Attention + TensorScatter cache writes into one ONNX Runtime
com.microsoft GroupQueryAttention (GQA) op, Q/K/V projections packed into one MatMul.

What export/emit.py writes per layer with --attention fused (x: the block's input):

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
    export/emit.py writes (a LessOrEqual of slots against positions), alone or with a
    sliding layer's window (And slot > position - W: GQA's local_window_size = W, the keys
    p - W < j <= p, as transformers' sliding_window), and a build verifies the rewritten graph
    against the graph before, on the same inputs.
What the 2026 families add (issue 34): a live per-head QK-norm (Qwen3, Gemma 3) stays as its op on
q and k, merged back to [B, S, H * D] for GQA (Q/K/V then stay three MatMuls); the attention
soft-cap (Gemma 2) is GQA's softcap; yarn's attention factor scales the cos / sin tables; a NoPE
layer (SmolLM3) gets none; Gemma 3's local and global layers get one table pair each. longrope past
its switch (a Where between two frequency sets) and partial rotary are not matched.
ORT-only: TensorRT's parser has no com.microsoft ops, so builds for TensorRT keep the
portable graph (graph_passes.trt_lint flags this op).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from core.contract import INPUT_IDS, POSITION, np_dtype
from graph_passes.base import NAME_SCOPES, GraphPass, Match, PassContext, Skip, const_value, is_float, producer
from graph_passes.lazy import concat

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
    packed: tuple | None                       # (x, [W], [b or None]) when q, k, v are MatMul(x, W) [+ b] of one x
    inv_freq: np.ndarray | None                # rotary embedding's inverse frequencies [D / 2], None without rope
    capacity: int                              # cache slots: rows of the cos / sin tables
    rope_scale: float = 1.0                    # yarn / longrope's attention factor on cos and sin
    softcap: float = 0.0                       # tanh soft-cap of the logits (Gemma 2); 0: none
    window: int = 0                            # sliding window (keys p - window < j <= p); 0: the whole cache
    normed: tuple = (None, None)               # the live per-head QK-norm ops on q, k ([B, S, H, D]), kept

    @property
    def detail(self) -> str:
        qkv = "Q/K/V packed into one MatMul" if self.packed else "Q/K/V kept apart"
        rope = ", rotary embedding inside" if self.inv_freq is not None else ""
        window = f", window {self.window}" if self.window else ""
        return (f"Attention + 2 TensorScatter -> GroupQueryAttention ({self.heads} heads, {self.kv_heads} kv), "
                f"{qkv}{rope}{window}")


def _single_consumer(t: gs.Tensor, op: str) -> gs.Node | None:
    return t.outputs[0] if len(t.outputs) == 1 and t.outputs[0].op == op else None


def _perm_is(node: gs.Node | None, perm) -> bool:
    return node is not None and node.op == "Transpose" and list(node.attrs.get("perm", [])) == perm


HEAD_NORMS = ("RMSNormalization", "SimplifiedLayerNormalization")


def _split_heads_input(t: gs.Tensor) -> tuple[gs.Tensor, gs.Node | None] | None:
    """(x, None) of Transpose(Reshape(x, [B, S, H, D]), perm 0213), x the 3-D tensor before the head split;
    (x, norm) of Transpose(norm(Reshape(x))), a live per-head QK-norm (Qwen3, Gemma 3) over the last axis."""
    tr = producer(t)
    if not _perm_is(tr, TO_BHSD):
        return None
    split, norm = tr.inputs[0], None
    src = producer(split)
    if src is not None and src.op in HEAD_NORMS and src.attrs.get("axis", -1) in (-1, 3) \
            and len(split.outputs) == 1:
        norm, split = src, src.inputs[0]
        src = producer(split)
    if src is None or src.op != "Reshape" or len(split.outputs) != 1:
        return None
    return src.inputs[0], norm


def _linear(t: gs.Tensor):
    """(x, W, b) of MatMul(x, W) + b, or (x, W, None) of MatMul(x, W), with a constant 2-D W
    (and 1-D b) and nothing else reading the MatMul; else None."""
    node = producer(t)
    if node is not None and node.op == "Add":
        for mm_in, b_in in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
            b = const_value(b_in)
            found = _linear(mm_in) if b is not None and b.ndim == 1 else None
            if found is not None and found[2] is None and found[1].shape[1] == b.shape[0]:
                return found[0], found[1], b
        return None
    if node is None or node.op != "MatMul" or len(t.outputs) != 1:
        return None
    w = const_value(node.inputs[1])
    return (node.inputs[0], w, None) if w is not None and w.ndim == 2 else None


def _name_like_q(ctx: PassContext, packed: gs.Node, q: gs.Tensor) -> None:
    """Give the packed Q/K/V MatMul the q projection's module path with its last part renamed
    (blocks.0.attn.q_proj -> blocks.0.attn.qkv_proj), so that reports and export.quantize's
    --int8-layers can name it."""
    node = producer(q)
    if node is not None and node.op == "Add":
        node = next((producer(t) for t in node.inputs if producer(t) is not None and producer(t).op == "MatMul"), None)
    scopes = ctx.scopes_of(node, NAME_SCOPES) if node is not None else []
    if len(scopes) >= 2:
        module = scopes[-2].rsplit(".", 1)
        scopes[-2] = ".".join(module[:-1] + ["qkv_proj"])
        ctx.node_meta[packed.name] = {NAME_SCOPES: repr(scopes)}


def _through(t: gs.Tensor, ops=("Unsqueeze",)) -> gs.Node | None:
    """The producer of t, looking through the given (shape-only) ops."""
    node = producer(t)
    while node is not None and node.op in ops:
        node = producer(node.inputs[0])
    return node


def _angles(t: gs.Tensor, trig: str) -> tuple[gs.Tensor, float] | None:
    """(f, a) of (Unsqueeze of) trig(Concat(f, f)) [* a] along the last axis: the rotary angles, HF layout,
    and the attention factor a scalar constant multiplies them by (yarn, longrope; 1 without)."""
    node, scale = _through(t), 1.0
    if node is not None and node.op == "Mul":
        consts = [const_value(i) for i in node.inputs]
        data = [i for i, c in zip(node.inputs, consts) if c is None]
        values = [c for c in consts if c is not None]
        if len(data) != 1 or len(values) != 1 or values[0].size != 1:
            return None
        node, scale = producer(data[0]), float(values[0].reshape(-1)[0])
    if node is None or node.op != trig:
        return None
    cat = producer(node.inputs[0])
    if cat is None or cat.op != "Concat" or cat.attrs.get("axis") not in (-1, 3) or len(cat.inputs) != 2 \
            or cat.inputs[0] is not cat.inputs[1]:
        return None
    return cat.inputs[0], scale


def _inv_freq(angles: gs.Tensor) -> np.ndarray | None:
    """The constant 1-D inv_freq of angles = positions * inv_freq."""
    mul = producer(angles)
    if mul is None or mul.op != "Mul":
        return None
    for t in mul.inputs:
        v = const_value(t)
        if v is not None and v.ndim == 1 and is_float(v.dtype):
            return v
    return None


def _is_rotate_half(r: gs.Tensor, x: gs.Tensor) -> bool:
    """r = Concat(-x2, x1) of the two halves (x1, x2) of x's last axis."""
    cat = producer(r)
    if cat is None or cat.op != "Concat" or cat.attrs.get("axis") not in (-1, 3) or len(cat.inputs) != 2:
        return False
    neg = producer(cat.inputs[0])
    split = producer(cat.inputs[1])
    if neg is None or neg.op != "Neg" or split is None or split.op != "Split" or split.inputs[0] is not x \
            or split.attrs.get("axis") not in (-1, 3) or len(split.outputs) != 2:
        return False
    sizes = const_value(split.inputs[1]) if len(split.inputs) > 1 else None
    halves = sizes is None or (len(sizes) == 2 and sizes[0] == sizes[1])
    return halves and cat.inputs[1] is split.outputs[0] and neg.inputs[0] is split.outputs[1]


def _rotary(t: gs.Tensor):
    """(x, inv_freq, a) of x * cos + rotate_half(x) * sin over the whole head (models/decoder.py's
    apply_rope with rotary_dim = head_dim), cos / sin = a cos / sin(cat(f, f)), f = positions * inv_freq."""
    add = producer(t)
    if add is None or add.op != "Add":
        return None
    muls = [producer(i) for i in add.inputs]
    if any(m is None or m.op != "Mul" for m in muls):
        return None
    for plain, rotated in (muls, muls[::-1]):
        for x, cos in ((plain.inputs[0], plain.inputs[1]), (plain.inputs[1], plain.inputs[0])):
            for r, sin in ((rotated.inputs[0], rotated.inputs[1]), (rotated.inputs[1], rotated.inputs[0])):
                if not _is_rotate_half(r, x):
                    continue
                c, s = _angles(cos, "Cos"), _angles(sin, "Sin")
                if c is not None and s is not None and c[0] is s[0] and c[1] == s[1]:
                    inv = _inv_freq(c[0])
                    return (x, inv, c[1]) if inv is not None else None
    return None


def _is_position_mask(t: gs.Tensor, depth: int = 6) -> bool:
    """The mask export/emit.py writes: (Unsqueeze of) a LessOrEqual of slots against positions."""
    return _mask_op(t, "LessOrEqual", depth) is not None


def _mask_op(t: gs.Tensor, op: str, depth: int = 6) -> gs.Node | None:
    node = producer(t)
    for _ in range(depth):
        if node is None:
            return None
        if node.op == op:
            return node
        if node.op not in ("Unsqueeze", "Expand", "Reshape"):
            return None
        node = producer(node.inputs[0])
    return None


def _mask_window(t: gs.Tensor) -> int | None:
    """0 for export/emit.py's slot <= position mask, W for a sliding layer's (that mask And slot >
    position - W: models/decoder.py's step_inputs), None for any other mask."""
    if _is_position_mask(t):
        return 0
    node = producer(t)
    if node is None or node.op != "And" or len(node.inputs) != 2:
        return None
    causal, window = node.inputs
    if not _is_position_mask(causal):
        causal, window = window, causal
    gt = _mask_op(window, "Greater")
    sub = None if gt is None else producer(gt.inputs[1])
    w = None if sub is None or sub.op != "Sub" else const_value(sub.inputs[1])
    if not _is_position_mask(causal) or w is None or w.size != 1 or w.dtype.kind not in "iu" or int(w.reshape(-1)[0]) < 1:
        return None
    return int(w.reshape(-1)[0])


class OrtGroupQueryAttention(GraphPass):
    name = "ort_gqa"
    summary = "Attention + TensorScatter cache writes -> com.microsoft GroupQueryAttention (ONNX Runtime only)"
    anchors = ("Attention",)

    # Pattern (exact; per layer, x the block's input, rope(t) = t cos + rotate_half(t) sin optional on q and k):
    #
    #     x ─▶ MatMul(Wq) [▶ Add(bq)] ─▶ Reshape ─▶ Transpose(0213) [▶ rope] ─────────────────────┐
    #     x ─▶ MatMul(Wk) [▶ Add(bk)] ─▶ Reshape ─▶ Transpose(0213) [▶ rope] ─▶ TensorScatter(key_i, ·, position) ─┤
    #     x ─▶ MatMul(Wv) [▶ Add(bv)] ─▶ Reshape ─▶ Transpose(0213) ─────────▶ TensorScatter(value_i, ·, position) ┤
    #                                            slot <= position + t mask (LessOrEqual) ─────────┤
    #                                                        Attention ◀─────────────────────────┘ ─▶ Transpose(0213) ─▶ Reshape ─▶ y
    #   ==>
    #     x ─▶ MatMul([Wq|Wk|Wv]) [▶ Add([bq|bk|bv])] ─▶ GroupQueryAttention(·, key_i, value_i, seqlens_k, total[, cos, sin]) ─▶ y
    #     (the TensorScatter outputs present_key_i / present_value_i become the op's second and third outputs)

    def __init__(self):
        self._lengths: dict[int, tuple[gs.Tensor, gs.Tensor]] = {}    # per graph: (seqlens_k, total_length)
        self._caches: dict[tuple, list[gs.Constant]] = {}            # per graph and rope: (cos, sin)

    def match(self, ctx: PassContext, att: gs.Node) -> GqaMatch | Skip | None:
        if att.domain not in (None, "", "ai.onnx") or len(att.inputs) != 4 or any(
                o.name and (o.outputs or ctx.is_graph_output(o)) for o in att.outputs[1:]):
            return Skip(f"{att.name}: expected Attention(q, k, v, mask) with one used output")
        if att.attrs.get("is_causal", 0) or att.attrs.get("qk_matmul_output_mode", 0):
            return Skip(f"{att.name}: expected is_causal 0, qk_matmul_output_mode 0")
        q, k, v, mask = att.inputs
        window = _mask_window(mask)
        if window is None:
            return Skip(f"{att.name}: the mask is not export/emit.py's slot <= position mask (with or without "
                        "a sliding window)")
        writes = (producer(k), producer(v))
        caches = []
        for w in writes:
            if w is None or w.op != "TensorScatter" or w.attrs.get("axis", -2) not in (-2, 2) \
                    or w.attrs.get("mode", "linear") not in ("linear", b"linear"):
                return Skip(f"{att.name}: key / value do not come from a TensorScatter cache write (axis -2)")
            cache, update, pos = w.inputs
            if not (cache in ctx.graph.inputs and pos.name == POSITION and ctx.is_graph_output(w.outputs[0])
                    and all(c is att for c in w.outputs[0].outputs)):
                return Skip(f"{att.name}: {w.name} does not write a graph-input cache at `position` into a graph output")
            caches.append((cache, update))
        q_in, k_in, inv_freq, rope_scale = q, caches[0][1], None, 1.0
        rq, rk = _rotary(q), _rotary(k_in)
        if rq is not None and rk is not None and np.array_equal(rq[1], rk[1]) and rq[2] == rk[2]:
            (q_in, inv_freq, rope_scale), k_in = rq, rk[0]    # GQA applies the rotation itself (do_rotary)
        splits = (_split_heads_input(q_in), _split_heads_input(k_in), _split_heads_input(caches[1][1]))
        if any(x is None for x in splits) or splits[2][1] is not None:
            return Skip(f"{att.name}: q / k / v are not Transpose(Reshape(x)) head splits (q and k may have a "
                        "per-head norm), with or without a full-width rotate-half rotary embedding (partial or "
                        "interleaved rotary is not matched)")
        x3 = tuple(x for x, _ in splits)
        normed = (splits[0][1], splits[1][1])
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
        if inv_freq is not None and (head_size % 16 or 2 * len(inv_freq) != head_size):
            return Skip(f"{att.name}: ORT's GroupQueryAttention rotates a head size that is a multiple of 16, over "
                        f"the whole head (found head size {head_size}, rotary dim {2 * len(inv_freq)})")
        if not any(t.name == INPUT_IDS for t in ctx.graph.inputs):
            return Skip(f"{att.name}: no input_ids graph input to take the step length from")
        lin = [_linear(x) for x in x3]
        packed = None
        if all(lin) and lin[0][0] is lin[1][0] is lin[2][0] and normed[0] is None and normed[1] is None:
            packed = (lin[0][0], [w for _, w, _ in lin], [b for _, _, b in lin])
        scale = att.attrs.get("scale")
        return GqaMatch(ctx.layer_name(att), att, writes, x3, out_rs.outputs[0], heads, kv_heads,
                        None if scale is None else float(scale), packed, inv_freq, int(cache_shape[2]),
                        rope_scale, float(att.attrs.get("softcap", 0.0)), window, normed)

    def _rotary_caches(self, ctx: PassContext, m: GqaMatch) -> list[gs.Constant]:
        """cos / sin [capacity, D / 2] of slot * inv_freq (times the attention factor), in fp32 as torch computes
        them; one pair per distinct rope in the graph (Gemma 3's local and global layers have two)."""
        key = (id(ctx.graph), m.inv_freq.tobytes(), m.rope_scale, m.capacity)
        if key not in self._caches:
            angles = np.arange(m.capacity, dtype=np.float32)[:, None] * m.inv_freq.astype(np.float32)[None, :]
            cos, sin = np.cos(angles), np.sin(angles)
            if m.rope_scale != 1.0:
                cos, sin = cos * np.float32(m.rope_scale), sin * np.float32(m.rope_scale)
            self._caches[key] = [ctx.const("gqa_cos_cache", cos), ctx.const("gqa_sin_cache", sin)]
        return self._caches[key]

    @staticmethod
    def _merge_heads(ctx: PassContext, x: gs.Tensor, norm: gs.Node | None) -> gs.Tensor:
        """GQA's 3-D input [B, S, H * D]: x itself, or the live per-head norm's output merged back."""
        if norm is None:
            return x
        out = norm.outputs[0]
        merged = gs.Variable(ctx.fresh_name(f"{out.name}_merged"), dtype=out.dtype,
                             shape=None if not out.shape else [*out.shape[:2], None])
        ctx.graph.nodes.append(gs.Node("Reshape", ctx.fresh_name("gqa_merge_heads"),
                                       inputs=[out, ctx.const("gqa_merged_shape", np.array([0, 0, -1], np.int64))],
                                       outputs=[merged]))
        return merged

    def _step_lengths(self, ctx: PassContext) -> tuple[gs.Tensor, gs.Tensor]:
        """seqlens_k = position + S - 1 (int32 [B]) and total_length = max(position) + S (int32 scalar), once per graph."""
        if id(ctx.graph) in self._lengths:
            return self._lengths[id(ctx.graph)]
        g = ctx.graph
        ids = next(t for t in g.inputs if t.name == INPUT_IDS)
        pos = next(t for t in g.inputs if t.name == POSITION)

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
            weight = ctx.const("qkv_weight", concat(ws, axis=1))
            shape = [*x.shape[:-1], weight.shape[1]] if x.shape else None
            qkv = gs.Variable(ctx.fresh_name("qkv"), dtype=x.dtype, shape=shape)
            g.nodes.append(gs.Node("MatMul", ctx.fresh_name("qkv_MatMul"), inputs=[x, weight], outputs=[qkv]))
            _name_like_q(ctx, g.nodes[-1], m.inputs_3d[0])
            if any(b is not None for b in bs):       # a missing bias is zeros: x + 0.0 is exact
                bias = concat([np.zeros(w.shape[1], w.dtype) if b is None else b for w, b in zip(ws, bs)], axis=0)
                summed = gs.Variable(ctx.fresh_name("qkv_biased"), dtype=x.dtype, shape=shape)
                g.nodes.append(gs.Node("Add", ctx.fresh_name("qkv_Add"), inputs=[qkv, ctx.const("qkv_bias", bias)],
                                       outputs=[summed]))
                qkv = summed
            qkv_inputs = [qkv, gs.Variable.empty(), gs.Variable.empty()]
        else:
            qkv_inputs = [self._merge_heads(ctx, x, norm) for x, norm in zip(m.inputs_3d, (*m.normed, None))]
        attrs = {"num_heads": m.heads, "kv_num_heads": m.kv_heads}
        if m.scale is not None:
            attrs["scale"] = m.scale
        if m.softcap:
            attrs["softcap"] = m.softcap
        if m.window:                   # GQA's local window: the keys p - window < j <= p (checked against torch)
            attrs["local_window_size"] = m.window
        rotary = []
        if m.inv_freq is not None:
            rotary = self._rotary_caches(ctx, m)
            attrs.update(do_rotary=1, rotary_interleaved=0)
        # the old producers let go of the tensors the new op now writes (cleanup drops them)
        for node in (k_write, v_write, producer(m.output_3d)):
            node.outputs.clear()
        g.nodes.append(gs.Node("GroupQueryAttention", ctx.fresh_name("GroupQueryAttention"), domain=MS_DOMAIN,
                               attrs=attrs, inputs=[*qkv_inputs, key_cache, value_cache, seqlens_k, total, *rotary],
                               outputs=[m.output_3d, present_k, present_v]))
        ctx.import_domain(MS_DOMAIN)
        ctx.model_meta["tapernorm.attention"] = "ort-gqa"


# --- the KV cache's dtype (export.build --kv-cache) ----------------------------------------------------

# How far an fp16 cache may move a graph's logits from the same graph with an fp32 cache, as a share
# of max |logits| (tests/graph_passes/test_ort_attention.py checks it over a prefill and the greedy steps
# after it: 39 in the default run, 255 after a 2048-token prompt in the slow one). Inside the fp16 GroupQueryAttention q, k, v and the rotary tables are rounded to fp16 (11
# significant bits, a relative step of 2^-11 ~ 0.05 %), and the keys and values stay rounded in the
# cache for every later step; softmax and the sums run in fp32 in ONNX Runtime's kernel. Measured on
# the 2-layer test models (100-token prompt, 150 steps): 1e-6 (GPT-2 style) and 1.5e-4 (Llama style,
# rotary) of max |logits|; deeper, trained models carry more (docs/export.md). 1 % leaves room for
# them and stays below what a whole-graph fp16 build is allowed (export/verify.py); a cache written at
# the wrong slot, or read as the wrong type, moves the logits by about their whole scale.
KV_CACHE_DRIFT = {"fp16": 0.01, "int8": 0.05}
_ELEM = {"fp32": onnx.TensorProto.FLOAT, "fp16": onnx.TensorProto.FLOAT16}


def with_cache_dtype(proto: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    """The GroupQueryAttention graph `proto` (ort_gqa's output) with its KV caches in `dtype` (fp16:
    half the bytes of fp32): the caches' graph inputs and outputs change type, and each
    GroupQueryAttention runs in that dtype, its q / k / v cast to it on the way in, its output cast back
    to fp32 on the way out, its cos / sin tables stored in it; everything else stays fp32.

    Why the whole op and not only its cache: ONNX Runtime 1.32's CPU kernel accepts an fp32 query
    with an fp16 cache, but then converts the whole cache to fp32 every step (a step at depth 100 of
    an 8192-slot cache cost ~100 ms against ~0.2 ms fp32, docs/export.md); with all its inputs fp16
    a step reads only the slots written. `proto` is changed in place and returned; fp32 returns it
    as it is. Raises ValueError for a graph without GroupQueryAttention over graph-input caches."""
    if dtype == "fp32":
        return proto
    if dtype not in _ELEM:
        raise ValueError(f"cache dtype {dtype!r}: expected one of {', '.join(_ELEM)} (int8: with_int8_cache, "
                         "with calibrated scales)")
    g, to = proto.graph, _ELEM[dtype]
    inits = {t.name: t for t in g.initializer}
    _retype_caches(proto, to)
    cast_of: dict[str, str] = {}        # fp32 tensor -> its cast (q/k/v) or converted table (cos / sin)
    nodes = []
    for original in g.node:
        node = onnx.NodeProto()
        node.CopyFrom(original)
        if not _is_gqa(node):
            nodes.append(node)
            continue
        for i, name in enumerate(node.input):
            if not name or i in (3, 4, 5, 6):        # absent, the caches, seqlens_k, total_length
                continue
            if name not in cast_of:
                cast_of[name] = f"{name}_{dtype}"
                if name in inits:                    # cos / sin: stored in the dtype (no per-step cast)
                    table = onnx.numpy_helper.to_array(inits[name]).astype(np_dtype(dtype))
                    g.initializer.append(onnx.numpy_helper.from_array(table, cast_of[name]))
                else:
                    nodes.append(onnx.helper.make_node("Cast", [name], [cast_of[name]], to=to,
                                                       name=f"{node.name}_in{i}_Cast"))
            node.input[i] = cast_of[name]
        out = node.output[0]
        node.output[0] = f"{out}_{dtype}"
        nodes.append(node)
        nodes.append(onnx.helper.make_node("Cast", [node.output[0]], [out], to=onnx.TensorProto.FLOAT,
                                           name=f"{node.name}_out_Cast"))
    unused = {n for n in cast_of if n in inits and not any(n in x.input for x in nodes)}
    kept_inits = [t for t in g.initializer if t.name not in unused]
    del g.initializer[:]
    g.initializer.extend(kept_inits)
    del g.node[:]
    g.node.extend(nodes)
    return proto


def _retype_caches(proto: onnx.ModelProto, to: int) -> list[onnx.NodeProto]:
    """Give the GroupQueryAttention caches' graph inputs and outputs the ONNX type `to` (no value_info left
    claiming another); returns the GroupQueryAttention nodes. ValueError when the caches are not graph I/O."""
    g = proto.graph
    inputs, outputs = {t.name: t for t in g.input}, {t.name: t for t in g.output}
    gqa = [n for n in g.node if _is_gqa(n)]
    caches = [(n.input[i], n.output[i - 2]) for n in gqa for i in (3, 4)]
    if not gqa or any(c not in inputs or p not in outputs for c, p in caches):
        raise ValueError("expected GroupQueryAttention nodes whose caches are graph inputs and outputs "
                         "(export.build --target ort-cpu)")
    for c, p in caches:
        inputs[c].type.tensor_type.elem_type = to
        outputs[p].type.tensor_type.elem_type = to
    dropped = {n for pair in caches for n in pair}
    kept = [v for v in g.value_info if v.name not in dropped]
    del g.value_info[:]
    g.value_info.extend(kept)
    return gqa


# --- the int8 KV cache (export.build --kv-cache int8) ---------------------------------------------------

# ONNX Runtime's CPU GroupQueryAttention keeps an int8 cache with static scales (k_scale / v_scale inputs,
# k_quant_type / v_quant_type PER_CHANNEL: one scale per key/value head and channel): it stores
# clip(round(k / scale)) of the keys it writes (after its rotary embedding) and the values, and reads
# them back times the scale, q / k / v and the output staying fp32. A step then reads a quarter of an
# fp32 cache's bytes (docs/export.md: 2.6-3.6x faster per cached position). The scales come from the
# keys and values of a calibration prefill (export/kv_int8.py): INT8_SCALE_ROOM times the largest |k|,
# |v| seen per channel, / 127; a key channel that the rotary embedding turns (d with d + D/2, GQA's
# half-split rotation) is bounded by the pair's norm, which no position's rotation exceeds.
INT8_SCALE_ROOM = 1.25      # head room over the calibration's largest value: text it did not see
INT8_MIN_SCALE = 1e-8       # a channel that stayed 0 (a scale of 0 would divide by zero)


def int8_scales(cache: np.ndarray, rotary: bool) -> np.ndarray:
    """The PER_CHANNEL scales [1, H_kv, 1, D] (fp32) of one cache from its calibration contents [B, H_kv, n, D]
    (the positions written); `rotary`: the keys of a GroupQueryAttention that rotates them (do_rotary)."""
    x = np.abs(np.asarray(cache, np.float32))
    if rotary:
        half = x.shape[-1] // 2
        pair = np.sqrt(np.square(x[..., :half]) + np.square(x[..., half:])).max(axis=(0, 2))      # [H_kv, D/2]
        largest = np.concatenate([pair, pair], axis=-1)
    else:
        largest = x.max(axis=(0, 2))                                                              # [H_kv, D]
    scale = np.maximum(largest * INT8_SCALE_ROOM / 127.0, INT8_MIN_SCALE)
    return scale.astype(np.float32)[None, :, None, :]


def rotated_key_caches(proto: onnx.ModelProto) -> set[str]:
    """The key caches whose GroupQueryAttention applies the rotary embedding before writing them."""
    out = set()
    for n in proto.graph.node:
        if _is_gqa(n) and any(a.name == "do_rotary" and a.i for a in n.attribute):
            out.add(n.input[3])
    return out


def with_int8_cache(proto: onnx.ModelProto, scales: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The GroupQueryAttention graph `proto` with int8 KV caches: the caches' graph I/O int8, each
    GroupQueryAttention given its caches' PER_CHANNEL scales (`scales`: cache input name -> [1, H_kv, 1, D]
    fp32, from int8_scales) as initializers and the quantization attributes; nothing else changes.
    `proto` is changed in place and returned. ValueError for a graph without GroupQueryAttention over
    graph-input caches, or a cache without its scales."""
    gqa = [n for n in proto.graph.node if _is_gqa(n)]
    missing = sorted({n.input[i] for n in gqa for i in (3, 4)} - set(scales))
    if missing:
        raise ValueError(f"int8 cache: expected scales for every cache, found none for {', '.join(missing[:4])}")
    _retype_caches(proto, onnx.TensorProto.INT8)
    for node in gqa:
        names = []
        for cache in (node.input[3], node.input[4]):
            names.append(f"{cache}_int8_scale")
            proto.graph.initializer.append(onnx.numpy_helper.from_array(
                np.asarray(scales[cache], np.float32), names[-1]))
        inputs = list(node.input) + [""] * (12 - len(node.input))         # k_scale, v_scale: inputs 12, 13
        del node.input[:]
        node.input.extend(inputs[:12] + names)
        node.attribute.extend([onnx.helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                               onnx.helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                               onnx.helper.make_attribute("kv_cache_bit_width", 8)])
    return proto


# ONNX Runtime 1.32's int8-cache kernel computes a prompt's attention from the quantized cache, ~3.5x slower
# per (query, key) pair than its fp32 kernel (1024 new tokens: 214 against 62 ms a layer, Qwen3-0.6B's heads;
# docs/export.md), which made an int8 build's prefill slower than llama.cpp's. A first prompt (no row has a past:
# the kernel's own test, sequence length == total length) runs the fp32 kernel without a past instead and
# writes the cache itself, the kernel's quantization spelt in ONNX: clip(round(x / scale)) to int8, the same
# bytes (round half to even, as the kernel rounds; a test compares them). Every other call (decode steps,
# a prompt after a past) takes the int8 kernel. The price is an If per layer on each step.
_QUANT_ATTRS = ("k_quant_type", "v_quant_type", "kv_cache_bit_width")


def with_fp32_first_prompt(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The int8-cache graph `proto` (with_int8_cache's output) with each GroupQueryAttention behind an If: a first
    prompt attends in fp32 and quantizes the keys and values it writes, padded to the cache's capacity; other
    calls run the node as it was. `proto` is changed in place and returned. ValueError when it has no int8-cache
    GroupQueryAttention."""
    g = proto.graph
    gqa = [n for n in g.node if _is_gqa(n) and any(a.name == "kv_cache_bit_width" for a in n.attribute)]
    if not gqa:
        raise ValueError("expected GroupQueryAttention nodes with an int8 cache (with_int8_cache's graph)")
    make, scope = onnx.helper.make_node, "first_prompt/"
    i64 = lambda name, values: onnx.numpy_helper.from_array(np.asarray(values, np.int64), scope + name)
    g.initializer.extend([i64("seq_axis", [1]), i64("cache_axis", [2]), i64("no_pads", np.zeros(6)), i64("no_pad", [0]),
                          onnx.numpy_helper.from_array(np.float32(-128), scope + "int8_min"),
                          onnx.numpy_helper.from_array(np.float32(127), scope + "int8_max")])
    n0 = gqa[0]
    shared = [make("Shape", [INPUT_IDS], [scope + "ids_shape"]),
              make("Gather", [scope + "ids_shape", scope + "seq_axis"], [scope + "new"], axis=0),
              make("Cast", [n0.input[6]], [scope + "total32"], to=onnx.TensorProto.INT64),
              make("Reshape", [scope + "total32", scope + "seq_axis"], [scope + "total"]),
              make("Equal", [scope + "new", scope + "total"], [scope + "is_first"]),
              make("Shape", [n0.input[3]], [scope + "cache_shape"]),
              make("Gather", [scope + "cache_shape", scope + "cache_axis"], [scope + "capacity"], axis=0),
              make("Sub", [scope + "capacity", scope + "new"], [scope + "room"]),
              make("Concat", [scope + "no_pads", scope + "room", scope + "no_pad"], [scope + "pads"], axis=0)]
    nodes = []
    for node in g.node:
        if node not in gqa:
            nodes.append(node)
            continue
        if node is n0:
            nodes.extend(shared)
        nodes.append(_first_prompt_if(node, scope))
    del g.node[:]
    g.node.extend(nodes)
    return proto


def _first_prompt_if(node: onnx.NodeProto, scope: str) -> onnx.NodeProto:
    """`node` (an int8-cache GroupQueryAttention) as If(first prompt: fp32 attention, the cache quantized here;
    else: `node`)."""
    make, name = onnx.helper.make_node, node.name
    out = lambda suffix, elem, rank: [onnx.helper.make_tensor_value_info(f"{name}/{o}_{suffix}", t, [None] * r)
                                      for o, t, r in zip(("output", "key", "value"), elem, rank)]
    types = (onnx.TensorProto.FLOAT, onnx.TensorProto.INT8, onnx.TensorProto.INT8)
    inputs = list(node.input)
    fp32_inputs = inputs[:3] + ["", ""] + inputs[5:12]
    while fp32_inputs[-1] == "":
        fp32_inputs.pop()
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute if a.name not in _QUANT_ATTRS}
    first = [make("GroupQueryAttention", fp32_inputs, [f"{name}/output_first"] + [f"{name}/{c}_fp32" for c in ("key", "value")],
                  domain=MS_DOMAIN, name=f"{name}/fp32", **attrs)]
    for c, scale in (("key", inputs[12]), ("value", inputs[13])):
        x = f"{name}/{c}"
        first += [make("Div", [f"{x}_fp32", scale], [f"{x}_scaled"]), make("Round", [f"{x}_scaled"], [f"{x}_rounded"]),
                  make("Clip", [f"{x}_rounded", scope + "int8_min", scope + "int8_max"], [f"{x}_clipped"]),
                  make("Cast", [f"{x}_clipped"], [f"{x}_int8"], to=onnx.TensorProto.INT8),
                  make("Pad", [f"{x}_int8", scope + "pads"], [f"{name}/{c}_first"])]
    inner = onnx.NodeProto()
    inner.CopyFrom(node)
    del inner.output[:]
    inner.output.extend(f"{name}/{o}_other" for o in ("output", "key", "value"))
    return make("If", [scope + "is_first"], list(node.output), name=f"{name}/first_prompt",
                then_branch=onnx.helper.make_graph(first, f"{name}_first", [], out("first", types, (3, 4, 4))),
                else_branch=onnx.helper.make_graph([inner], f"{name}_other", [], out("other", types, (3, 4, 4))))


def _is_gqa(node: onnx.NodeProto) -> bool:
    return node.op_type == "GroupQueryAttention" and node.domain == MS_DOMAIN
