"""Shared matching and folding of a per-channel affine map into the linear layer BEFORE it.

Not a pass itself: linear_fold.py folds a scale into the layers a tensor feeds; this folds it into
the layer that made the tensor, for the norms that no matrix follows. A TaperNorm at g = 0 on a
QK-norm (a per-head diagonal applied before the rotary embedding) or on a post-sublayer norm (the
attention's or MLP's output before the residual add) is y = z * s (+ t), z the output of a matrix:

    z = x @ W + b             y = z * s + t  =  x @ (W diag(S)) + (b * S + T)

S, T: s and t repeated over the heads when z is split into heads [.., H, D] and s has D channels.

    x ─▶ MatMul(W) ─▶ [Add(b)] ─▶ [Reshape [.., H, D]] ─▶ [Slice / Split (last axis)] ─▶ Mul(s) ─▶ [Add(t)] ─▶ y
  ==>
    x ─▶ MatMul(W') ─▶ Add(b') ─▶ [Reshape] ─▶ [Slice / Split] ─▶ y

What may stand between the matrix and the Mul (`trace_producer`; anything else stops the fold with
one line saying which node and why):
- the matrix's bias Add (a constant vector over its output columns);
- a Reshape that splits the last axis into heads [.., H, D] (or keeps it): the scale of a head's
  channel repeats over the H heads;
- a Slice (constant bounds, step 1) or Split of the last axis: Q, K and V computed by one MatMul;
  only the columns that part reads are scaled, so the other parts see what they saw before.
Every tensor on the way may feed only the next node (a Split's other outputs excepted), so that no
other node sees a scaled value; the matrix's weight is written as a NEW constant (it may be shared).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from graph_passes.base import Match, PassContext, Skip, const_value, producer, static_last_dim
from graph_passes.lazy import digest, lazy_map, transposed
from graph_passes.linear_fold import ChannelAffine, linear_weight, match_linear, short_label


@dataclass
class Producer:
    """The linear layer whose output columns [start, stop) the scaled tensor reads, repeated `heads` times."""
    linear: gs.Node                  # the MatMul or Gemm (its weight and bias are read again at the rewrite)
    start: int
    stop: int
    label: str


@dataclass
class OutputFold(Match):
    """A per-channel affine map y = z * s + t whose z a linear layer computes: folded into it."""
    y: gs.Tensor                     # what the Mul (or its shift Add) computes: its readers read z after the fold
    z: gs.Tensor
    affine: ChannelAffine
    producer: Producer
    what: str = ""

    @property
    def detail(self) -> str:
        return f"{self.what or self.affine.describe()} -> output of {self.producer.label}"


def _slice_range(node: gs.Node, width: int) -> tuple[int, int] | None:
    """[start, stop) of the last axis of a width-`width` tensor that a Slice with constant bounds reads."""
    if len(node.inputs) < 3:
        return None
    starts, ends = const_value(node.inputs[1]), const_value(node.inputs[2])
    axes = const_value(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3].name else None
    steps = const_value(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4].name else None
    rank = len(node.inputs[0].shape or [])
    if starts is None or ends is None or starts.size != 1 or ends.size != 1:
        return None
    if axes is None or axes.size != 1 or int(axes.reshape(-1)[0]) not in (-1, rank - 1):
        return None
    if steps is not None and int(steps.reshape(-1)[0]) != 1:
        return None
    start, stop = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
    start, stop = (start + width if start < 0 else start), (stop + width if stop < 0 else stop)
    return max(0, min(start, width)), max(0, min(stop, width))


def _split_range(node: gs.Node, t: gs.Tensor, width: int) -> tuple[int, int] | None:
    """[start, stop) of the last axis that output `t` of a last-axis Split reads."""
    rank = len(node.inputs[0].shape or [])
    if node.attrs.get("axis", 0) not in (-1, rank - 1):
        return None
    sizes = const_value(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1].name else None
    n = len(node.outputs)
    if sizes is None:
        if width % n:
            return None
        sizes = np.full(n, width // n)
    bounds = np.concatenate([[0], np.cumsum(sizes.reshape(-1))])
    i = next(k for k, o in enumerate(node.outputs) if o is t)
    return int(bounds[i]), int(bounds[i + 1])


def trace_producer(ctx: PassContext, z: gs.Tensor, width: int) -> Producer | Skip:
    """The linear layer that computes z (scaled by `width` channels on its last axis) and the columns of
    its output that z is; or Skip(why not)."""
    t, needed = z, width            # needed: the producer's columns z covers (the scale's, times the heads)
    for _ in range(4):
        node = producer(t)
        if node is None:
            return Skip(f"{t.name} is not computed by a node (a graph input or constant)")
        if len(t.outputs) != 1 or ctx.is_graph_output(t):
            return Skip(f"{t.name} is read by {len(t.outputs)} nodes: scaling its producer would change what the "
                        "others read")
        if node.op == "Reshape":
            src, shape = node.inputs[0], node.outputs[0].shape
            src_last = static_last_dim(src)
            if src_last is None or not shape or len(shape) < 2 or not all(
                    isinstance(s, (int, np.integer)) for s in shape[-2:]):
                return Skip(f"{node.name} (Reshape): the head split of the last axis is not known statically")
            if shape[-1] != src_last:
                if shape[-1] != needed or shape[-2] * shape[-1] != src_last:
                    return Skip(f"{node.name} (Reshape) turns {src_last} channels into {list(shape[-2:])}, not "
                                f"heads of {needed}")
                needed *= int(shape[-2])
            t = src
            continue
        if node.op in ("Slice", "Split"):
            full = static_last_dim(node.inputs[0])
            rng = None if full is None else (_slice_range(node, full) if node.op == "Slice"
                                             else _split_range(node, t, full))
            if rng is None or rng[1] - rng[0] != needed:
                return Skip(f"{node.name} ({node.op}) is not a constant part of the last axis of {needed} channels")
            return _linear_columns(ctx, node.inputs[0], needed, rng)
        return _linear_columns(ctx, t, needed, None)
    return Skip(f"{z.name}: no linear layer within 4 nodes")


def _linear_columns(ctx: PassContext, z: gs.Tensor, needed: int, columns: tuple[int, int] | None) -> Producer | Skip:
    """The MatMul / Gemm (and its bias Add) computing z; columns: the part of z the scaled tensor is (every
    other reader of z must be a Slice / Split reading its own part), None: all of it."""
    if columns is not None:
        whole = [r for r in z.outputs if r.op not in ("Slice", "Split")]
        if whole or ctx.is_graph_output(z):
            return Skip(f"{z.name} is also read whole{f' by {whole[0].name} ({whole[0].op})' if whole else ''}")
    node = producer(z)
    if node is not None and node.op == "Add":
        bias = [i for i in node.inputs if const_value(i) is not None]
        data = [i for i in node.inputs if const_value(i) is None]
        mm = producer(data[0]) if len(data) == 1 else None
        if len(bias) != 1 or const_value(bias[0]).ndim != 1 or mm is None or mm.op != "MatMul" \
                or len(data[0].outputs) != 1:
            return Skip(f"{node.name} (Add) is not the bias of a matrix whose output nothing else reads")
        node = mm
    if node is None or node.op not in ("MatMul", "Gemm"):
        return Skip(f"{z.name} is computed by {node.op if node is not None else 'no node'}, not a linear layer "
                    "(or its bias, head split or part)")
    use = match_linear(ctx, node.inputs[0], node)
    if isinstance(use, Skip):
        return use
    start, stop = columns or (0, use.weight.shape[1])
    if stop - start != needed:
        return Skip(f"{node.name} writes {stop - start} columns there, the scale covers {needed}")
    return Producer(node, start, stop, short_label(ctx, node))


def fold_into_producer(ctx: PassContext, match: OutputFold) -> None:
    """W' = W diag(S) and b' = b * S + T over the producer's columns [start, stop); the Mul's (and shift
    Add's) readers read z. Float64, cast back to the weight's dtype; NEW constants."""
    p, affine = match.producer, match.affine
    w = linear_weight(p.linear)        # as it is now: a pre-norm's fold may have rewritten it since the match
    reps = (p.stop - p.start) // (len(affine.scale) if affine.scale is not None else 1)
    cols = np.ones(w.shape[1])
    if affine.scale is not None:
        cols[p.start:p.stop] = np.tile(affine.scale.astype(np.float64), reps) if affine.scale.size > 1 else \
            float(affine.scale.reshape(-1)[0])
    dtype = w.dtype
    new_w = lazy_map(w, lambda a: np.multiply(a, cols[None, :], dtype=np.float64).astype(dtype),   # [in, out]
                     tag=("cols", digest(cols)))
    node = p.linear
    base = node.name or "linear"
    if node.op == "MatMul":
        node.inputs[1] = ctx.const(f"{base}.weight", new_w)
    else:
        node.inputs[1] = ctx.const(f"{base}.weight", transposed(new_w) if node.attrs.get("transB", 0) else new_w)
    shift = np.zeros(w.shape[1])
    if affine.shift is not None:
        shift[p.start:p.stop] = np.tile(affine.shift.astype(np.float64), reps) if affine.shift.size > 1 else \
            float(affine.shift.reshape(-1)[0])
    _rewrite_bias(ctx, p, cols, shift, w.dtype)
    for reader in list(match.y.outputs):
        for i, t in enumerate(reader.inputs):
            if t is match.y:
                reader.inputs[i] = match.z
    for i, t in enumerate(ctx.graph.outputs):
        if t is match.y:
            ctx.graph.outputs[i] = match.z


def _bias_add(node: gs.Node) -> gs.Node | None:
    """The Add of a constant vector that alone reads the MatMul's output (its bias), or None."""
    out = node.outputs[0]
    if node.op != "MatMul" or len(out.outputs) != 1 or out.outputs[0].op != "Add":
        return None
    add = out.outputs[0]
    consts = [const_value(t) for t in add.inputs if t is not out]
    return add if len(add.inputs) == 2 and len(consts) == 1 and consts[0] is not None and consts[0].ndim == 1 else None


def _rewrite_bias(ctx: PassContext, p: Producer, cols: np.ndarray, shift: np.ndarray, dtype) -> None:
    """The producer's bias scaled by the columns' scale, plus the shift (a new bias Add when it had none).
    The bias is looked up now: a pre-norm's shift folded since the match may have added one."""
    node = p.linear
    add = _bias_add(node)
    def scaled(b, times: float):           # b * times * cols + shift (b may be a Lazy: a folded shift's)
        return lazy_map(b, lambda a: (np.broadcast_to(a.astype(np.float64).reshape(-1) * times, cols.shape) * cols
                                      + shift).astype(dtype), cols.shape, dtype,
                        tag=("bias_cols", times, digest(cols, shift), str(dtype)))
    if add is not None:
        i, b_in = next((i, t) for i, t in enumerate(add.inputs) if const_value(t) is not None)
        add.inputs[i] = ctx.const(f"{add.name or 'bias'}.bias", scaled(const_value(b_in), 1.0))
        return
    if node.op == "Gemm" and len(node.inputs) > 2 and node.inputs[2].name:
        beta = float(node.attrs.get("beta", 1.0))
        node.attrs["beta"] = 1.0
        node.inputs[2] = ctx.const(f"{node.name}.bias", scaled(const_value(node.inputs[2]), beta))
        return
    if not shift.any():
        return
    out = node.outputs[0]
    mid = gs.Variable(ctx.fresh_name(out.name), dtype=out.dtype, shape=out.shape)
    node.outputs[0] = mid
    ctx.graph.nodes.append(gs.Node("Add", name=ctx.fresh_name(f"{node.name}.bias_add"),
                                   inputs=[mid, ctx.const(f"{node.name}.bias", shift.astype(dtype))], outputs=[out]))
