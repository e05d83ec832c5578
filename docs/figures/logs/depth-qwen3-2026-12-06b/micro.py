import time, sys, numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto as TP
H, KVH, D, S = 16, 8, 128, 8448
def model(kind):
    ct = {"fp32": TP.FLOAT, "int8": TP.INT8}[kind]
    ins = [helper.make_tensor_value_info("q", TP.FLOAT, ["b", "t", H*D]),
           helper.make_tensor_value_info("k", TP.FLOAT, ["b", "t", KVH*D]),
           helper.make_tensor_value_info("v", TP.FLOAT, ["b", "t", KVH*D]),
           helper.make_tensor_value_info("pk", ct, ["b", KVH, S, D]),
           helper.make_tensor_value_info("pv", ct, ["b", KVH, S, D]),
           helper.make_tensor_value_info("sl", TP.INT32, ["b"]),
           helper.make_tensor_value_info("tl", TP.INT32, [])]
    outs = [helper.make_tensor_value_info("o", TP.FLOAT, None), helper.make_tensor_value_info("ppk", ct, None),
            helper.make_tensor_value_info("ppv", ct, None)]
    inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D)); ang = np.outer(np.arange(S), inv)
    inits = [onnx.numpy_helper.from_array(np.cos(ang).astype(np.float32), "cos"),
             onnx.numpy_helper.from_array(np.sin(ang).astype(np.float32), "sin")]
    inputs = ["q", "k", "v", "pk", "pv", "sl", "tl", "cos", "sin"]
    attrs = dict(num_heads=H, kv_num_heads=KVH, do_rotary=1, rotary_interleaved=0)
    if kind == "int8":
        inits += [onnx.numpy_helper.from_array(np.full((1, KVH, 1, D), 0.05, np.float32), n) for n in ("ks", "vs")]
        inputs += ["", "", "", "ks", "vs"]
        attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
    node = helper.make_node("GroupQueryAttention", inputs, ["o", "ppk", "ppv"], domain="com.microsoft", **attrs)
    g = helper.make_graph([node], "g", ins, outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
if __name__ == '__main__':
    so = ort.SessionOptions(); so.intra_op_num_threads = 2
    for kind in ("fp32", "int8"):
        s = ort.InferenceSession(model(kind).SerializeToString(), so, providers=["CPUExecutionProvider"])
        dt = np.float32 if kind == "fp32" else np.int8
        for T in (int(x) for x in sys.argv[1].split(",")):
            r = np.random.default_rng(0)
            feed = dict(q=r.standard_normal((1, T, H*D), np.float32), k=r.standard_normal((1, T, KVH*D), np.float32),
                        v=r.standard_normal((1, T, KVH*D), np.float32), pk=np.zeros((1, KVH, S, D), dt), pv=np.zeros((1, KVH, S, D), dt),
                        sl=np.array([T-1], np.int32), tl=np.array(T, np.int32))
            ts = []
            for _ in range(2):
                t = time.perf_counter(); s.run(None, feed); ts.append(time.perf_counter() - t)
            # a decode step at depth T
            feed1 = dict(feed, q=feed["q"][:, :1], k=feed["k"][:, :1], v=feed["v"][:, :1], sl=np.array([T], np.int32), tl=np.array(T+1, np.int32))
            ds = []
            for _ in range(5):
                t = time.perf_counter(); s.run(None, feed1); ds.append(time.perf_counter() - t)
            print(kind, T, f"prefill {min(ts)*1e3:.1f} ms/layer, decode {min(ds)*1e3:.2f} ms/layer", flush=True)
