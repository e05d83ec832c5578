# a chunk of C new tokens at depth P: fp32 against int8 GroupQueryAttention (io binding, caches in place)
import time, sys, numpy as np, onnxruntime as ort
sys.path.insert(0, __import__("os").path.dirname(__file__))
from micro import model, H, KVH, D, S
so = ort.SessionOptions(); so.intra_op_num_threads = 2
C = int(sys.argv[1]); depths = [int(x) for x in sys.argv[2].split(",")]
r = np.random.default_rng(0)
N = max(depths) + C
q = r.standard_normal((1, N, H*D), np.float32); k = r.standard_normal((1, N, KVH*D), np.float32); v = r.standard_normal((1, N, KVH*D), np.float32)
for kind in ("fp32", "int8"):
    s = ort.InferenceSession(model(kind).SerializeToString(), so, providers=["CPUExecutionProvider"])
    dt = np.float32 if kind == "fp32" else np.int8
    pk = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, KVH, S, D), dt)); pv = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, KVH, S, D), dt))
    def step(a, b):
        io = s.io_binding()
        io.bind_cpu_input("q", q[:, a:b]); io.bind_cpu_input("k", k[:, a:b]); io.bind_cpu_input("v", v[:, a:b])
        io.bind_ortvalue_input("pk", pk); io.bind_ortvalue_input("pv", pv)
        io.bind_cpu_input("sl", np.array([b - 1], np.int32)); io.bind_cpu_input("tl", np.array(b, np.int32))
        io.bind_output("o"); io.bind_ortvalue_output("ppk", pk); io.bind_ortvalue_output("ppv", pv)
        t = time.perf_counter(); s.run_with_iobinding(io); return time.perf_counter() - t
    out = []
    for P in depths:
        out.append(f"P={P}: {min(step(P, P + C) for _ in range(2))*1e3:.1f}")
    print(kind, f"chunk {C}:", ", ".join(out), "ms/layer", flush=True)
