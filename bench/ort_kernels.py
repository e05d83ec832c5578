"""python -m bench.ort_kernels [--threads N] [--rounds N] [--d-model D] [--vocab V] [--capacity N] [--kv-cache fp32,fp16]
                             [--json OUT]

Times the two ONNX Runtime CPU kernels that a decode step of an `--attention gqa --quantize
int4` build (and GenAI's equal-shape build) spends nearly all its time in, one op per
session, batch 1, one token, so that "ours vs GenAI" can be read against what the kernels
allow: both graphs call the same kernels on the same bytes.

    MatMulNBits   x [1, 1, K] @ W [K, N] in 4 bits, block 32, accuracy level 4 (int8
                  activations) and 0 (fp32 compute): the MLP (d x 4d, 4d x d) and the LM
                  head (d x V); GB/s = weight bytes (int4 + fp32 scales) / time
    GQA           com.microsoft GroupQueryAttention, packed QKV, rotary inside, the KV cache
                  shared as past and present (as our OrtSession binds it), at three cached
                  lengths; default scale vs scale 1 (the scale moved into Wq); with --kv-cache
                  fp32,fp16 also the op as `export.build --kv-cache fp16` writes it (q / k / v,
                  caches, tables and output fp16), at the default scale

Random weights (speed does not depend on the values); median [min-max] of --rounds rounds,
each the mean of enough calls to take ~0.1 s, after a warm-up.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import timeit
from pathlib import Path

import numpy as np

BLOCK = 32
MS = "com.microsoft"


def _timed(run, rounds: int, budget_s: float = 0.1) -> list[float]:
    """Seconds per call, one figure per round (each the mean over ~budget_s of calls)."""
    for _ in range(3):
        run()
    calls = max(3, int(budget_s / max(timeit.timeit(run, number=1), 1e-6)))
    return [t / calls for t in timeit.repeat(run, number=calls, repeat=rounds)]


def _bound(graph, threads: int, inputs: dict, outputs: dict, shared: dict | None = None):
    """A run closure over a CPU session of the one-op `graph` and an IO binding: numpy inputs and
    outputs bound once; `shared` names one OrtValue bound as input and output (a cache updated in place)."""
    import onnxruntime as ort
    from onnx import helper
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    b = sess.io_binding()
    for name, arr in inputs.items():
        b.bind_cpu_input(name, arr)
    for name, arr in outputs.items():
        b.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(arr))
    held = []
    for (inp, out), arr in (shared or {}).items():
        held.append(ort.OrtValue.ortvalue_from_numpy(arr))
        b.bind_ortvalue_input(inp, held[-1])
        b.bind_ortvalue_output(out, held[-1])
    ro = ort.RunOptions()
    ro.add_run_config_entry("gpu_graph_id", "-1")       # see runtime/ort_session.py
    return lambda: sess.run_with_iobinding(b, ro)


def matmul_nbits(k: int, n: int, level: int, threads: int, rounds: int) -> dict:
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    blob = rng.integers(0, 256, (n, k // BLOCK, BLOCK // 2), dtype=np.uint8)
    scales = (rng.random((n, k // BLOCK), dtype=np.float32) * 0.01).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain=MS, K=k, N=n, bits=4, block_size=BLOCK,
                            accuracy_level=level)
    graph = helper.make_graph([node], "mnb", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, n])],
                              [numpy_helper.from_array(blob, "B"), numpy_helper.from_array(scales, "S")])
    secs = _timed(_bound(graph, threads, {"x": rng.random((1, 1, k), dtype=np.float32)},
                         {"y": np.empty((1, 1, n), np.float32)}), rounds)
    return {"op": "MatMulNBits", "K": k, "N": n, "accuracy_level": level, "us": [s * 1e6 for s in secs],
            "weight_MB": (blob.nbytes + scales.nbytes) / 1e6}


def gqa(heads: int, head_size: int, capacity: int, cached: int, scale: float | None, threads: int,
        rounds: int, cache: str = "fp32") -> dict:
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    f, nf = (TensorProto.FLOAT16, np.float16) if cache == "fp16" else (TensorProto.FLOAT, np.float32)
    attrs = dict(num_heads=heads, kv_num_heads=heads, do_rotary=1, rotary_interleaved=0)
    if scale is not None:
        attrs["scale"] = scale
    inv_freq = 1.0 / 10000 ** (np.arange(0, head_size, 2, dtype=np.float32) / head_size)
    angles = np.arange(capacity, dtype=np.float32)[:, None] * inv_freq[None]
    shape = [1, heads, capacity, head_size]                                          # [B, H, S_max, D]
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "k", "v", "seqlens_k", "total", "cos", "sin"],
                            ["y", "present_k", "present_v"], domain=MS, **attrs)
    graph = helper.make_graph(
        [node], "gqa",
        [helper.make_tensor_value_info("qkv", f, [1, 1, 3 * heads * head_size]),
         helper.make_tensor_value_info("k", f, shape), helper.make_tensor_value_info("v", f, shape),
         helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
         helper.make_tensor_value_info("total", TensorProto.INT32, [])],
        [helper.make_tensor_value_info("y", f, [1, 1, heads * head_size]),
         helper.make_tensor_value_info("present_k", f, shape), helper.make_tensor_value_info("present_v", f, shape)],
        [numpy_helper.from_array(np.cos(angles).astype(nf), "cos"), numpy_helper.from_array(np.sin(angles).astype(nf), "sin")])
    secs = _timed(_bound(graph, threads,
                         {"qkv": rng.random((1, 1, 3 * heads * head_size), dtype=np.float32).astype(nf),
                          "seqlens_k": np.array([cached - 1], np.int32), "total": np.array(cached, np.int32)},
                         {"y": np.empty((1, 1, heads * head_size), nf)},
                         {("k", "present_k"): rng.random(shape, dtype=np.float32).astype(nf),
                          ("v", "present_v"): rng.random(shape, dtype=np.float32).astype(nf)}), rounds)
    return {"op": "GroupQueryAttention", "heads": heads, "head_size": head_size, "cached": cached,
            "scale": "default" if scale is None else scale, "kv_cache": cache, "us": [s * 1e6 for s in secs]}


def _summary(us: list[float]) -> str:
    return f"{np.median(us):8.1f} us [{min(us):.1f}-{max(us):.1f}]"


def _caches(text: str) -> tuple[str, ...]:
    """argparse type of --kv-cache: a comma list of fp32, fp16."""
    import argparse
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values or any(v not in ("fp32", "fp16") for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected fp32 and / or fp16, comma-separated, e.g. fp32,fp16")
    return values


def run(argv: list[str]) -> int:
    from core.errors import ArgumentParser, UsageError, int_in
    from core.outputs import write_json
    ap = ArgumentParser(prog="python -m bench.ort_kernels", description=__doc__.split("\n\n")[1])
    ap.add_argument("--threads", type=int_in(1, 256), default=1, help="intra-op threads (default 1)")
    ap.add_argument("--rounds", type=int_in(1, 1000), default=7, help="timed rounds per kernel (default 7)")
    ap.add_argument("--d-model", type=int_in(64, 16384), default=768, help="model width (default 768: 124M, 12 heads of 64)")
    ap.add_argument("--vocab", type=int_in(1, 1 << 20), default=50257, help="LM head width (default 50257)")
    ap.add_argument("--capacity", type=int_in(32, 1 << 16), default=160, help="KV cache slots (default 160)")
    ap.add_argument("--kv-cache", type=_caches, default=("fp32",), metavar="fp32[,fp16]",
                    help="the GroupQueryAttention's cache dtypes to time (default fp32; fp16 as export.build "
                         "--kv-cache fp16 writes the op)")
    ap.add_argument("--json", type=Path, help="also write the figures here (a JSON report)")
    args = ap.parse_args(argv)
    d = args.d_model
    if d % 64:
        raise UsageError(f"--d-model {d}: expected a multiple of 64 (heads of 64, blocks of {BLOCK}); e.g. 768")
    print(f"bench.ort_kernels: d_model {d}, vocab {args.vocab}, {args.threads} thread(s), {args.rounds} rounds")
    rows = []
    for k, n in ((d, 4 * d), (4 * d, d), (d, args.vocab)):
        for level in (4, 0):
            r = matmul_nbits(k, n, level, args.threads, args.rounds)
            r["GB_per_s"] = r["weight_MB"] / np.median(r["us"]) * 1e3         # MB per us -> GB/s
            print(f"  MatMulNBits K {k:5d} N {n:6d} level {level}: {_summary(r['us'])}  {r['GB_per_s']:5.1f} GB/s")
            rows.append(r)
    for cached in (17, args.capacity // 2, args.capacity - 16):
        for cache, scale in [(c, sc) for c in args.kv_cache for sc in ((None, 1.0) if c == "fp32" else (None,))]:
            r = gqa(d // 64, 64, args.capacity, cached, scale, args.threads, args.rounds, cache)
            print(f"  GroupQueryAttention {d // 64} heads, {cached:4d} cached, {cache} cache, scale "
                  f"{str(r['scale']):7s}: {_summary(r['us'])}")
            rows.append(r)
    if args.json:
        import onnxruntime
        write_json(args.json, {"command": "python -m bench.ort_kernels " + " ".join(argv),
                               "onnxruntime": onnxruntime.__version__, "rows": rows})
    return 0


def main(argv=None) -> int:
    from core.lifecycle import run_cli
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
