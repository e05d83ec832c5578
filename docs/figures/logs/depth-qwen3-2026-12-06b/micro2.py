import time, sys, numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto as TP
H, KVH, D, S = 16, 8, 128, 8448
sys.path.insert(0, __import__("os").path.dirname(__file__))
def base(kind):
    from micro import model
    return model(kind)
def with_if(m):
    g = m.graph
    gqa = g.node[0]
    nodes = []
    C = lambda name, arr: onnx.numpy_helper.from_array(np.asarray(arr), name)
    g.initializer.extend([C("i64_1", np.array([1], np.int64)), C("i64_2", np.array([2], np.int64)),
                          C("zeros6", np.zeros(6, np.int64)), C("qmin", np.float32(-128)), C("qmax", np.float32(127)), C("zero1", np.array([0], np.int64))])
    nodes += [helper.make_node("Shape", ["q"], ["q_shape"]), helper.make_node("Gather", ["q_shape", "i64_1"], ["t1"], axis=0),
              helper.make_node("Cast", ["tl"], ["tl64"], to=TP.INT64), helper.make_node("Reshape", ["tl64", "i64_1"], ["tl1"]) ,
              helper.make_node("Equal", ["t1", "tl1"], ["first1"]), helper.make_node("Squeeze", ["first1"], ["first"]),
              helper.make_node("Shape", ["pk"], ["pk_shape"]), helper.make_node("Gather", ["pk_shape", "i64_2"], ["cap1"], axis=0),
              helper.make_node("Sub", ["cap1", "t1"], ["room"]),
              helper.make_node("Concat", ["zeros6", "room", "zero1"], ["pads"], axis=0)]
    # then: fp32 attention without a past, the new keys / values quantized into the cache
    a = dict((x.name, helper.get_attribute_value(x)) for x in gqa.attribute if x.name in ("num_heads", "kv_num_heads", "do_rotary", "rotary_interleaved"))
    then = [helper.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "sl", "tl", "cos", "sin"], ["o_f", "pk32", "pv32"], domain="com.microsoft", **a)]
    for src, sc, dst in (("pk32", "ks", "ppk_t"), ("pv32", "vs", "ppv_t")):
        then += [helper.make_node("Div", [src, sc], [src + "_d"]), helper.make_node("Round", [src + "_d"], [src + "_r"]),
                 helper.make_node("Clip", [src + "_r", "qmin", "qmax"], [src + "_c"]), helper.make_node("Cast", [src + "_c"], [src + "_q"], to=TP.INT8),
                 helper.make_node("Pad", [src + "_q", "pads"], [dst])]
    then += [helper.make_node("Identity", ["o_f"], ["o_t"])]
    outs = lambda sfx: [helper.make_tensor_value_info("o" + sfx, TP.FLOAT, None), helper.make_tensor_value_info("ppk" + sfx, TP.INT8, None), helper.make_tensor_value_info("ppv" + sfx, TP.INT8, None)]
    then_g = helper.make_graph(then, "prefill", [], outs("_t"))
    node = onnx.NodeProto(); node.CopyFrom(gqa); del node.output[:]; node.output.extend(["o_e", "ppk_e", "ppv_e"])
    else_g = helper.make_graph([node], "decode", [], outs("_e"))
    nodes.append(helper.make_node("If", ["first"], ["o", "ppk", "ppv"], then_branch=then_g, else_branch=else_g))
    del g.node[:]; g.node.extend(nodes)
    return m
so = ort.SessionOptions(); so.intra_op_num_threads = 2
T = int(sys.argv[1])
r = np.random.default_rng(0)
q = r.standard_normal((1, T + 8, H*D), np.float32); k = r.standard_normal((1, T + 8, KVH*D), np.float32); v = r.standard_normal((1, T + 8, KVH*D), np.float32)
res = {}
for name, m in (("int8", base("int8")), ("if", with_if(base("int8")))):
    pass
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    pk = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, KVH, S, D), np.int8)); pv = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, KVH, S, D), np.int8))
    def step(a, b):
        io = s.io_binding()
        io.bind_cpu_input("q", q[:, a:b]); io.bind_cpu_input("k", k[:, a:b]); io.bind_cpu_input("v", v[:, a:b])
        io.bind_ortvalue_input("pk", pk); io.bind_ortvalue_input("pv", pv)
        io.bind_cpu_input("sl", np.array([b - 1], np.int32)); io.bind_cpu_input("tl", np.array(b, np.int32))
        io.bind_output("o"); io.bind_ortvalue_output("ppk", pk); io.bind_ortvalue_output("ppv", pv)
        t = time.perf_counter(); s.run_with_iobinding(io); dt = time.perf_counter() - t
        return io.copy_outputs_to_cpu()[0], dt
    o_pre, t_pre = step(0, T)
    outs, ts = [], []
    for i in range(8):
        o, dt = step(T + i, T + i + 1); outs.append(o); ts.append(dt)
    res[name] = (o_pre, np.concatenate(outs, 1), pk.numpy().copy(), pv.numpy().copy())
    print(name, f"prefill {t_pre*1e3:.1f} ms, decode min {min(ts)*1e3:.3f} median {np.median(ts)*1e3:.3f} ms", flush=True)
a, b = res["int8"], res["if"]
print("prefill out max|diff|", np.abs(a[0] - b[0]).max(), "scale", np.abs(a[0]).max())
print("decode out max|diff|", np.abs(a[1] - b[1]).max())
print("k cache int8 differing", int((a[2] != b[2]).sum()), "max", int(np.abs(a[2].astype(int) - b[2]).max()), "v", int((a[3] != b[3]).sum()))
