"""Small decoder-like graphs built in code with onnx.helper (no checked-in .onnx files),
and a runner with ONNX Runtime optimizations off."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OPSET = 24
D, OUT = 8, 6


def init(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def rng_vec(seed: int, n: int = D, loc: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=n) * 0.3 + loc).astype(np.float32)


def rng_mat(seed: int, shape=(D, OUT)) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def model(nodes, inits, outputs=("y",), inputs=(("x", [2, 3, D]),), meta=None, node_meta=None) -> onnx.ModelProto:
    """A model over float inputs; outputs are float tensors of unknown shape."""
    g = helper.make_graph(
        nodes, "fixture",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=10)
    for k, v in (meta or {}).items():
        m.metadata_props.add(key=k, value=v)
    for node in m.graph.node:
        for k, v in (node_meta or {}).get(node.name, {}).items():
            node.metadata_props.add(key=k, value=v)
    return m


def taper_meta(layer: str, cls: str = "models.norms.TaperNorm", op: str = "mul") -> dict:
    """Node metadata as torch's exporter (and export/emit.py) writes it for a module `layer`."""
    scopes = ["", "model"] + [f"model.{'.'.join(layer.split('.')[:i + 1])}" for i in range(len(layer.split('.')))] + [op]
    return {"pkg.torch.onnx.name_scopes": repr(scopes),
            "pkg.torch.onnx.class_hierarchy": repr(["export.emit.DecodeStep", cls, "aten.mul.Tensor"])}


def run(m: onnx.ModelProto, feeds: dict) -> dict:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def x_feed(seed: int = 0, shape=(2, 3, D)) -> dict:
    return {"x": np.random.default_rng(seed).normal(size=shape).astype(np.float32)}


def ops(m: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in m.graph.node]


def assert_same(before: onnx.ModelProto, after: onnx.ModelProto, feeds=None, atol=1e-5) -> None:
    feeds = feeds or x_feed()
    a, b = run(before, feeds), run(after, feeds)
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=atol, rtol=1e-5, err_msg=k)


def scale_to_linears(scale=None, shift=None, n_linear=3, bias=True, scale_shape=None, gemm=False,
                     extra_consumer=None, meta=True) -> onnx.ModelProto:
    """x ─▶ Mul(s) ─▶ [Add(t)] ─▶ MatMul(W_i) [▶ Add(b_i)] (i < n_linear), outputs y_i.

    extra_consumer: an op type ('Relu') that also reads the scaled tensor (must block the fold).
    """
    scale = rng_vec(1) if scale is None else scale
    s_val = scale if scale_shape is None else scale.reshape(scale_shape)
    nodes = [helper.make_node("Mul", ["x", "s"], ["h"], name="ln_mul")]
    inits = [init("s", s_val)]
    node_meta = {"ln_mul": taper_meta("blocks.0.ln_1")} if meta else {}
    h = "h"
    if shift is not None:
        nodes.append(helper.make_node("Add", ["h", "t"], ["h2"], name="ln_add"))
        inits.append(init("t", shift))
        if meta:
            node_meta["ln_add"] = taper_meta("blocks.0.ln_1", op="add")
        h = "h2"
    outs = []
    for i in range(n_linear):
        w = rng_mat(10 + i)
        if gemm:
            inits += [init(f"W{i}", w.T.copy()), init(f"b{i}", rng_vec(20 + i, OUT, 0.0))]
            nodes.append(helper.make_node("Gemm", [h, f"W{i}", f"b{i}"], [f"y{i}"], name=f"gemm{i}", transB=1, alpha=0.5, beta=2.0))
        else:
            inits.append(init(f"W{i}", w))
            if bias:
                inits.append(init(f"b{i}", rng_vec(20 + i, OUT, 0.0)))
                nodes += [helper.make_node("MatMul", [h, f"W{i}"], [f"m{i}"], name=f"mm{i}"),
                          helper.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"], name=f"bias{i}")]
            else:
                nodes.append(helper.make_node("MatMul", [h, f"W{i}"], [f"y{i}"], name=f"mm{i}"))
        outs.append(f"y{i}")
    if extra_consumer:
        nodes.append(helper.make_node(extra_consumer, [h], ["z"], name="extra"))
        outs.append("z")
    inputs = (("x", [6, D]),) if gemm else (("x", [2, 3, D]),)
    return model(nodes, inits, outputs=outs, inputs=inputs, meta={"tapernorm.gate": "0.0"} if meta else None,
                 node_meta=node_meta)


def exploded_rmsnorm(cls: str | None = "transformers.models.llama.modeling_llama.LlamaRMSNorm", extra=(),
                     reshape=None, x_shape=(2, 3, D)) -> onnx.ModelProto:
    """HF RMSNorm as torch's exporter writes it, then q/k/v projections:

        x ─▶ Pow(2) ─▶ ReduceMean(-1) ─▶ Add(eps) ─▶ Sqrt ─▶ Reciprocal ─┐
        x ──────────────────────────────────────────────────────────────┴▶ Mul ─▶ Mul(gamma) ─▶ n
        n ─▶ MatMul(W_i) (i < 3); n ─▶ Shape ─▶ shape_out

    cls: the gamma Mul's provenance class (None: no provenance). extra: op types that
    also read n. reshape: a target shape for a Reshape between n and the MatMuls.
    """
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"], name="pow"),
             helper.make_node("ReduceMean", ["sq", "axes"], ["var"], name="mean", keepdims=1),
             helper.make_node("Add", ["var", "eps"], ["ve"], name="add_eps"),
             helper.make_node("Sqrt", ["ve"], ["std"], name="sqrt"),
             helper.make_node("Reciprocal", ["std"], ["inv"], name="rsqrt"),
             helper.make_node("Mul", ["x", "inv"], ["xn"], name="normalize"),
             helper.make_node("Mul", ["g", "xn"], ["n"], name="gamma_mul"),
             helper.make_node("Shape", ["n"], ["shape_out"], name="shape")]
    inits = [init("two", np.float32(2.0)), init("axes", np.array([-1], np.int64)), init("eps", np.float32(1e-6)),
             init("g", rng_vec(4))]
    src, width = "n", D
    if reshape is not None:
        nodes.append(helper.make_node("Reshape", ["n", "rs"], ["nr"], name="view"))
        inits.append(init("rs", np.array(reshape, np.int64)))
        src, width = "nr", reshape[-1]
    outs = []
    for i in range(3):
        nodes.append(helper.make_node("MatMul", [src, f"W{i}"], [f"y{i}"], name=f"proj{i}"))
        inits.append(init(f"W{i}", rng_mat(10 + i, (width, OUT))))
        outs.append(f"y{i}")
    for j, op in enumerate(extra):
        nodes.append(helper.make_node(op, ["n"], [f"z{j}"], name=f"extra{j}"))
        outs.append(f"z{j}")
    meta = {}
    if cls:
        meta["gamma_mul"] = {"pkg.torch.onnx.name_scopes": repr(["", "model", "model.layers.0", "model.layers.0.input_layernorm", "mul_1"]),
                             "pkg.torch.onnx.class_hierarchy": repr(["transformers.models.llama.modeling_llama.LlamaModel",
                                                                     cls, "aten.mul.Tensor"])}
    m = model(nodes, inits, outputs=outs, inputs=(("x", list(x_shape)),), node_meta=meta)
    m.graph.output.append(helper.make_tensor_value_info("shape_out", TensorProto.INT64, None))
    return m


def merged_decoder(n_scales: int = 2) -> onnx.ModelProto:
    """Optimum's merged-decoder layout, reduced: If(use_cache_branch) whose two branches
    each scale x per channel (a norm gain) and project it; the weights live in the main graph.

        use_cache_branch ─▶ If ─┬─ then: x ─▶ Mul(s_a) ─▶ MatMul(W_a) ─▶ y
                                └─ else: x ─▶ Mul(s_b) ─▶ MatMul(W_b) ─▶ y
    """
    def branch(tag: str, seed: int):
        nodes = [helper.make_node("Mul", ["x", f"s_{tag}"], [f"h_{tag}"], name=f"norm_{tag}"),
                 helper.make_node("MatMul", [f"h_{tag}", f"W_{tag}"], [f"y_{tag}"], name=f"proj_{tag}")]
        return helper.make_graph(nodes, f"branch_{tag}", [], [helper.make_tensor_value_info(f"y_{tag}", TensorProto.FLOAT, [2, 3, OUT])])
    node = helper.make_node("If", ["use_cache_branch"], ["y"], name="optimum::if",
                            then_branch=branch("a", 1), else_branch=branch("b", 2))
    inits = [init("s_a", rng_vec(1)), init("W_a", rng_mat(2)), init("s_b", rng_vec(3)), init("W_b", rng_mat(4))]
    m = model([node], inits)
    m.graph.input.append(helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1]))
    return m
