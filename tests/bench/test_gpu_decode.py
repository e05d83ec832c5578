"""bench.gpu_decode's whole pipeline on the CPU (no CUDA graphs): models, interleaved rounds, the summary
and its speed-up figures; the CUDA run itself happens in bench/gpu_check.sh on a GPU machine."""
from __future__ import annotations

import numpy as np

from bench.gpu_decode import BASELINE, FUSED, format_cell, run_benchmark, summarize_cell


def test_summary_ratio_is_per_round_tokens_per_s():
    # baseline steps 2 ms, fused 1.6 / 1.6 / 2.0 ms per round: speed-ups 1.25, 1.25, 1.0
    per_round = {BASELINE: [np.full(4, 2e-3)] * 3,
                 FUSED[1]: [np.full(4, 1.6e-3), np.full(4, 1.6e-3), np.full(4, 2e-3)]}
    cell = summarize_cell(per_round, batch=8)
    s = cell[FUSED[1]]["speedup_vs_baseline"]
    assert (round(s["min"], 6), round(s["median"], 6), round(s["max"], 6)) == (1.0, 1.25, 1.25)
    assert cell[BASELINE]["tokens_per_s"] == 8 / 2e-3 and "speedup_vs_baseline" not in cell[BASELINE]
    assert "x1.250 [1.000, 1.250]" in format_cell("124M", "bf16", 8, cell)


def test_run_benchmark_on_cpu_covers_every_cell():
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # tiny steps: more threads only contend on a shared machine
    lines = []
    try:
        r = run_benchmark(["1M"], ["fp32", "bf16"], [1, 2], prompt=4, steps=3, warmup=2, rounds=3, seed=0,
                          log=lines.append, device="cpu")
    finally:
        torch.set_num_threads(threads)
    assert [(c["dtype"], c["batch"]) for c in r["cells"]] == [("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2)]
    for c in r["cells"]:
        assert set(c["variants"]) == {BASELINE, *FUSED}
        assert all(v["steps"] == 9 and v["step_p50_s"] > 0 for v in c["variants"].values())   # 3 rounds x 3 steps
        assert all("speedup_vs_baseline" in c["variants"][f] for f in FUSED)
        assert c["sources"][BASELINE].startswith("zoo:baseline")      # the zoo's 1M models where they fit
    assert len(lines) == 4 and lines[0].startswith("torch-cpu 1M fp32 b1: rmsnorm-strong")


def test_a_real_shapes_pair_runs_on_cpu_and_folds_every_norm():
    """--shapes: a family shape (Gemma 3's, scaled down here) as rmsnorm-strong against all-taper-fused, the
    same random weights, c calibrated; the fused one has no norm module left, and its logits stay finite."""
    import torch
    from bench.gpu_decode import shape_models
    from bench.shapes import SHAPES
    tiny = dict(SHAPES["gemma-3-1b"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, intermediate_size=96, vocab_size=256, sliding_window=8,
                _name_or_path="tiny-gemma-3")
    models, sources = shape_models(tiny, 32, 0, "cpu")
    assert set(models) == {BASELINE, "all-taper-fused"} and sources[BASELINE].startswith("random:seed0 (tiny-gemma-3")
    left = [type(m).__name__ for m in models["all-taper-fused"].modules() if "Norm" in type(m).__name__]
    assert left == []
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        assert torch.isfinite(models["all-taper-fused"](ids)).all()
    r = run_benchmark([], ["fp32"], [1], prompt=4, steps=2, warmup=1, rounds=3, seed=0, device="cpu", shapes=[tiny])
    assert [c["size"] for c in r["cells"]] == ["tiny-gemma-3"]
    assert "speedup_vs_baseline" in r["cells"][0]["variants"]["all-taper-fused"]
