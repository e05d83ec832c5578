"""One decode step of a small portable graph against its depth and its cache capacity (issue 44):
2 layers with Qwen3-0.6B's attention and MLP (d_model 1024, 16 heads, 8 kv heads, head_dim 128,
swiglu 3072, per-head QK-norm, rope), vocabulary 4096 (so the head does not hide the attention), fp32,
ONNX Runtime CPU through runtime.ort_session (caches bound in place, graph optimizations on).

    PYTHONPATH=<tree> python decode_depth.py [--rounds 5] [--steps 10] [--threads 2]

Graphs: export.emit's portable graph as built (`live`: from LIVE_CUT_FROM slots an If per layer on
CUT_BELOW x L <= S_max, L = max(position) + T, whose branch cuts the caches to L) and the same with live_cut=False
(`whole`: attention over the whole cache, every step), plain and fused, at capacities 256 (below
LIVE_CUT_FROM: both are the same graph) and 8192. Each round runs every (graph, depth) once in an
order rotated per round (bench.stats.round_order): `--steps` one-token steps at position = depth (d tokens cached, the step reads d + 1 slots)
(the caches hold zeros: their values do not change what a step costs), the round's value the median
step (last_inference_time: ONNX Runtime's run). Printed: ms min / median / max over the rounds.
"""
import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.stats import Spread, median, round_order
from core.onnx_writer import save_onnx
from graph_passes.lazy import materialized
from models.decoder import Decoder, DecoderConfig
from models.weights import model_weights
from runtime.ort_session import OrtSession

QWEN3_HEADS = dict(vocab_size=4096, d_model=1024, n_layer=2, n_head=16, n_kv_head=8, head_size=128, mlp="swiglu",
                   mlp_hidden=3072, norm="rmsnorm", qk_norm="head", pos_embedding="rope", rope_theta=1e6,
                   qkv_bias=False, out_bias=False, mlp_bias=False, eps=1e-6)
# (capacity, depth) pairs: depth 100 at both capacities, and the depth sweep at 8192
POINTS = ((256, 100), (8192, 100), (8192, 1000), (8192, 2000), (8192, 2700), (8192, 3000), (8192, 4000), (8192, 8000))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from export.emit import emit_graph
    emitters = {"live": emit_graph, "whole": lambda *a: emit_graph(*a, live_cut=False)}
    out = Path(tempfile.mkdtemp(prefix="live-slots-"))
    sessions = {}
    for capacity in sorted({c for c, _ in POINTS}):
        torch.manual_seed(0)
        with torch.no_grad():
            model = Decoder(DecoderConfig(max_seq_len=capacity, **QWEN3_HEADS)).eval()
        for tree, emit in emitters.items():
            for form in ("plain", "fused"):
                e = emit(model_weights(model), "fp32", form)
                path = out / f"{tree}-{form}-{capacity}.onnx"
                save_onnx(materialized(e.proto, e.lazy), path)
                s = OrtSession(path, intra_op_threads=args.threads).activate()
                s.reset(1)
                sessions[tree, form, capacity] = s
    runs = [(tree, form, c, d) for (tree, form, c) in sessions for cc, d in POINTS if cc == c]
    times = {r: [] for r in runs}
    token = np.array([7], np.int64)
    for r in range(args.rounds):
        for tree, form, c, d in round_order(runs, r):
            s, steps = sessions[tree, form, c], []
            s.decode_step(token, np.array([d], np.int64))                 # warm this shape
            for _ in range(args.steps):
                s.decode_step(token, np.array([d], np.int64))             # d tokens cached, the step reads d + 1
                steps.append(s.last_inference_time())
            times[tree, form, c, d].append(median(steps) * 1e3)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"ms per decode step, {args.rounds} rounds x {args.steps} steps, {args.threads} threads: min / median / max")
    for key in runs:
        sp = Spread.of(times[key])
        print(f"{key[0]:6s} {key[1]:5s} capacity {key[2]:5d} depth {key[3]:5d}: "
              f"{sp.min:8.2f} {sp.median:8.2f} {sp.max:8.2f}")


if __name__ == "__main__":
    main()
