"""Time prefill_rows(rows, T) on the 1B int4 build: the per-call and per-token costs the scheduler's model uses."""
import sys, time, itertools
import numpy as np
from runtime.ort_session import OrtSession
s = OrtSession(sys.argv[1], intra_op_threads=2).activate()
s.reset(16)
rng = np.random.default_rng(0)
grid = [(1, 3), (1, 5), (1, 13), (1, 28), (2, 5), (2, 13), (2, 28), (4, 5), (4, 13), (4, 28), (8, 5), (8, 13), (16, 13), (1, 64), (1, 112)]
for n, T in grid[:2]:
    s.prefill_rows(0, rng.integers(100, 5000, (n, T)), np.zeros(n, np.int64), T - 1)
res = {g: [] for g in grid}
for r in range(3):
    for n, T in (grid if r % 2 == 0 else grid[::-1]):
        ids = rng.integers(100, 5000, (n, T))
        t0 = time.perf_counter()
        s.prefill_rows(0, ids, np.zeros(n, np.int64), T - 1)
        res[(n, T)].append(time.perf_counter() - t0)
for (n, T), v in res.items():
    print(f"rows {n:2d} T {T:3d} tokens {n*T:4d}  min {min(v)*1e3:7.1f} ms  med {sorted(v)[1]*1e3:7.1f} ms  per token {min(v)/(n*T)*1e3:5.2f} ms")
