"""The decode-step graph with the optional `logits_from` input: logits for positions [logits_from, seq) only.

    ... ─▶ ln_f ─▶ MatMul(W_head) ─▶ [Div, soft-cap] ─▶ logits [B, T, V]
    ... ─▶ ln_f ─▶ Slice(axis 1, logits_from:) ─▶ MatMul(W_head) ─▶ [Div, soft-cap] ─▶ logits [B, T - logits_from, V]

Why: a prefill needs the next-token logits of the last prompt token only, but the graph computed the head for
every prompt token. Llama-3.2-1B's tied 128k-entry head is a fifth of its weights' arithmetic, and its fp32
output 0.5 MB per token (a 16-row, 32-token prefill of the 1B int4 graph: 8.6 s with every position's logits,
6.8 s with the last's; ORT CPU, 2 threads).

`logits_from` is a graph input that is also an initializer of value [0]: ONNX's input with a default (ONNX
Runtime lists it among the session's overridable initializers). A caller that does not feed it (the build's
verification, ONNX Runtime GenAI, a user's own session) gets every position's logits, as before.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from core.contract import LOGITS, LOGITS_FROM

HEAD_OPS = ("MatMul", "MatMulNBits")      # the LM head, plain or quantized (export/quantize.py)
ELEMENTWISE = ("Add", "Div", "Mul", "Tanh")  # what may follow it: a folded norm's bias, the divisor, the soft-cap
TAIL_DIM = "logits_seq"                   # the logits' second axis: seq - logits_from


def with_logits_from(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` with the Slice before its LM head and the `logits_from` input (changed in place and returned).
    The head is found from the logits output back through element-wise ops (the divisor, the soft-cap) to
    its MatMul. Raises ValueError for a graph without that shape, or that takes logits_from already."""
    g = proto.graph
    if any(t.name == LOGITS_FROM for t in g.input):
        raise ValueError(f"the graph takes {LOGITS_FROM} already")
    producer = {o: n for n in g.node for o in n.output}
    head, after = producer.get(LOGITS), []
    while head is not None and head.op_type in ELEMENTWISE:       # back from the logits over the divisor,
        after.append(head.output[0])                                # the soft-cap, a folded norm's bias
        head = next((producer[x] for x in head.input if x in producer and producer[x].op_type != "Constant"), None)
    if head is None or head.op_type not in HEAD_OPS:
        raise ValueError(f"expected the {LOGITS} output computed by a {' or '.join(HEAD_OPS)} head (then "
                         f"element-wise ops only), found {head.op_type if head is not None else 'no producer'}")
    hidden, tail = head.input[0], f"{head.input[0]}_{LOGITS_FROM}"
    end, axis = f"{LOGITS_FROM}_end", f"{LOGITS_FROM}_axis"
    g.initializer.extend([numpy_helper.from_array(np.zeros(1, np.int64), LOGITS_FROM),
                          numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), end),
                          numpy_helper.from_array(np.ones(1, np.int64), axis)])
    g.input.append(helper.make_tensor_value_info(LOGITS_FROM, TensorProto.INT64, [1]))
    cut = helper.make_node("Slice", [hidden, LOGITS_FROM, end, axis], [tail], name=f"/{LOGITS_FROM}/Slice")
    nodes = list(g.node)
    nodes.insert(nodes.index(head), cut)
    head.input[0] = tail
    del g.node[:]
    g.node.extend(nodes)
    stale = {head.output[0], *after}     # their seq axis is seq - logits_from now: let shape inference say so
    kept = [v for v in g.value_info if v.name not in stale]
    del g.value_info[:]
    g.value_info.extend(kept)
    out = next(o for o in g.output if o.name == LOGITS)
    out.type.tensor_type.shape.dim[1].ClearField("dim_value")
    out.type.tensor_type.shape.dim[1].dim_param = TAIL_DIM
    return proto
