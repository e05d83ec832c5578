"""python -m bench.gpu_decode [--sizes 1M,8M,30M,124M] [--shapes qwen3-0.6b,...] [--dtypes fp32,bf16] [--batches 1,8] [--json FILE]

The paper's headline on a GPU: decode steps with a KV cache, RMSNorm baseline vs the
norm-free tapered models with their scales folded, on the `torch` backend with CUDA
graphs (runtime.torch_session: one captured graph per batch size, replayed each step).

    variants   rmsnorm-strong (F.rms_norm, gamma folded), internal-taper-fused,
               all-taper-fused (bench/variants.py: zoo weights where the shape fits, random else)
    --shapes   a real shape of bench/shapes.py (e.g. qwen3-0.6b, gemma-3-1b: QK-norms, sandwich norms),
               random-init on the GPU: rmsnorm-strong (its gamma folded where it can be) against
               all-taper-fused (every norm a TaperNorm at g = 0, c calibrated on random tokens, folded):
               issue 34's CPU pair (bench/fold_vs_genai.py) on the GPU
    per (size, dtype, batch)
               one TorchSession per variant, cache allocated and graph captured once;
               ROUNDS rounds, each timing STEPS decode steps of every variant after WARMUP
               untimed ones, in an order rotated each round (bench.stats.round_order)
    reported   step time p50 per variant (all rounds pooled), tokens/s = batch / p50, and each
               fused variant's speed-up over rmsnorm-strong per round: median [min, max]

A step is runtime.step_timing.time_decode_steps' step: tokens in, graph replay, logits
[B, V] copied to pinned host memory, stream synchronized, so the clock reads finished work.
Positions run from PROMPT to PROMPT + WARMUP + STEPS (short contexts: the norm share of a
step is largest there). Speed only: correctness of the CUDA-graph decode is a gpu test
(tests/runtime/test_torch_session.py).
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import copy
import functools
import time

import numpy as np

from bench import stats
from bench.options import batch_sizes, comma_list
from core.errors import ArgumentParser, UserError, int_in, seed_int
from core.lifecycle import run_cli

BASELINE = "rmsnorm-strong"
FUSED = ("internal-taper-fused", "all-taper-fused")
DEFAULT_SIZES = ("1M", "8M", "30M", "124M")


def time_cell(sessions: dict, batch: int, prompt: int, steps: int, warmup: int, rounds: int) -> dict:
    """{variant: [per-round step-time lists]} for one batch size, variants interleaved per round."""
    from runtime.step_timing import time_decode_steps
    names = list(sessions)
    per_round: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for r in range(rounds):
        for name in stats.round_order(names, r):
            t = time_decode_steps(sessions[name], batch=batch, prompt_len=prompt, steps=steps, warmup=warmup)
            per_round[name].append(t["step"])
    return per_round


def summarize_cell(per_round: dict, batch: int) -> dict:
    """p50 step time, tokens/s and per-round speed-ups over the baseline (tokens/s ratio = inverse time ratio)."""
    out = {}
    base = [float(np.median(r)) for r in per_round.get(BASELINE, [])]
    for name, rounds in per_round.items():
        pooled = np.concatenate(rounds)
        p50 = float(np.median(pooled))
        row = {"step_p50_s": p50, "step_min_s": float(pooled.min()), "step_max_s": float(pooled.max()),
               "tokens_per_s": batch / p50, "steps": int(pooled.size)}
        if base and name != BASELINE:
            mine = [float(np.median(r)) for r in rounds]
            row["speedup_vs_baseline"] = stats.ratio_summary([1 / m for m in mine], [1 / b for b in base]).as_dict()
        out[name] = row
    return out


def size_models(size: str, capacity: int, seed: int, device: str) -> tuple[dict, dict]:
    """bench/variants.py's models of a size: {variant: model}, {variant: where its weights come from}."""
    from bench.variants import VARIANTS, base_model, torch_variant
    base = functools.cache(lambda kind: base_model(size, kind, capacity, seed))    # once per kind
    names = (BASELINE, *FUSED)
    return ({n: torch_variant(VARIANTS[n], base(VARIANTS[n].kind)[0]) for n in names},
            {n: base(VARIANTS[n].kind)[1] for n in names})


def shape_models(shape, capacity: int, seed: int, device: str) -> tuple[dict, dict]:
    """A real shape's pair, random-init on `device` (one fp32 model at a time before the fold):
    rmsnorm-strong and all-taper-fused (every norm a TaperNorm at g = 0, c calibrated on random tokens in
    order: train.calibration.calibrate_in_order, so the random model stays finite through its layers)."""
    import torch
    from bench.shapes import resolve_shape
    from models.convert import decoder_config_of
    from models.decoder import Decoder
    from models.fold import fold_norms
    from train.calibration import calibrate_in_order
    name, raw = resolve_shape(shape)
    cfg = decoder_config_of(raw, capacity, f"shape {name}")
    torch.manual_seed(seed)
    with torch.device(device):
        rms = Decoder(cfg).eval()
    taper_cfg = copy.deepcopy(cfg)
    taper_cfg.norm, taper_cfg.taper_scope = "taper", "all"
    with torch.device("meta"):
        taper = Decoder(taper_cfg)
    taper.load_state_dict(rms.state_dict(), strict=False, assign=True)        # the same tensors
    for layer in taper.taper_layers().values():
        layer.weight_tilde = torch.nn.Parameter(torch.empty_like(layer.weight))
    if taper_cfg.tie_embeddings:
        taper.lm_head.weight = taper.wte.weight
    for rotary in taper.rotaries().values():
        rotary.reset_parameters(device)
    from bench.fold_vs_genai import finite_init
    finite_init(taper)                   # (the baseline's W_o / W_down too: they are the same tensors)
    g = torch.Generator(device=device).manual_seed(seed)
    calibrate_in_order(taper.eval(), torch.randint(0, cfg.vocab_size, (4, 64), generator=g, device=device))
    source = f"random:seed{seed} ({name}, all-taper c calibrated on random tokens)"
    return {BASELINE: fold_norms(rms), "all-taper-fused": fold_norms(taper)}, {BASELINE: source, "all-taper-fused": source}


def run_benchmark(sizes, dtypes, batches, prompt: int, steps: int, warmup: int, rounds: int, seed: int,
                  log=print, device: str = "cuda", shapes=()) -> dict:
    """Every (size or shape, dtype, batch) cell; device="cpu" runs the same code without CUDA graphs (tests)."""
    import torch

    from bench.variants import capacity_for, weight_bytes_torch
    from runtime.torch_session import TorchSession
    capacity = capacity_for(prompt, warmup + steps + 1)
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else None
    results = {"device": gpu or device, "torch": torch.__version__, "cuda": torch.version.cuda,
               "prompt": prompt, "steps": steps, "warmup": warmup, "rounds": rounds, "capacity": capacity,
               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cells": []}
    todo = [(s, size_models) for s in sizes] + [(s, shape_models) for s in shapes]
    for size, make in todo:
        models, sources = make(size, capacity, seed, device)
        size = size if isinstance(size, str) else size.get("_name_or_path", "shape")
        weight_bytes = {n: weight_bytes_torch(m) for n, m in models.items()}        # fp32, before any cast
        for dtype in dtypes:
            # TorchSession moves and casts the module in place; each dtype starts from the fp32 weights
            sessions = {n: TorchSession(copy.deepcopy(m), device=device, dtype=dtype).activate()
                        for n, m in models.items()}
            try:
                for batch in batches:
                    cell = summarize_cell(time_cell(sessions, batch, prompt, steps, warmup, rounds), batch)
                    results["cells"].append({"size": size, "dtype": dtype, "batch": batch, "variants": cell,
                                             "sources": sources, "weight_bytes_fp32": weight_bytes})
                    log(format_cell(size, dtype, batch, cell, device))
            finally:
                for s in sessions.values():
                    s.deactivate()
                if gpu:
                    torch.cuda.empty_cache()
    return results


def format_cell(size: str, dtype: str, batch: int, cell: dict, device: str = "cuda") -> str:
    parts = []
    for name, row in cell.items():
        text = f"{name} {row['step_p50_s'] * 1e6:.1f} us ({row['tokens_per_s']:.0f} tok/s)"
        if "speedup_vs_baseline" in row:
            s = row["speedup_vs_baseline"]
            text += f" x{s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}]"
        parts.append(text)
    return f"torch-{device.split(':')[0]} {size} {dtype} b{batch}: " + "; ".join(parts)


def run(argv: list[str]) -> int:
    from bench.variants import SIZES
    p = ArgumentParser(prog="python -m bench.gpu_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", help=f"comma list of {', '.join(SIZES)} (default {','.join(DEFAULT_SIZES)} "
                                   "without --shapes)")
    p.add_argument("--shapes", help="comma list of bench/shapes.py real shapes (e.g. qwen3-0.6b,gemma-3-1b): "
                                    "rmsnorm-strong vs all-taper-fused at that shape, random-init")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, fp16, bf16")
    p.add_argument("--batches", default="1,8", help="comma list of batch sizes in [1, 256]")
    p.add_argument("--prompt", type=int_in(1, 4096), default=16)
    p.add_argument("--steps", type=int_in(1, 100_000), default=128, help="timed decode steps per round")
    p.add_argument("--warmup", type=int_in(1, 100_000), default=16)
    p.add_argument("--rounds", type=int_in(3, 1000), default=5, help="interleaved rounds, >= 3")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of random weights where no zoo model fits")
    p.add_argument("--json", help="also write the results here (a JSON report)")
    a = p.parse_args(argv)
    from bench.shapes import SHAPES
    shapes = comma_list(a.shapes, "--shapes", SHAPES, "shape") if a.shapes else []
    sizes = comma_list(a.sizes, "--sizes", SIZES, "size") if a.sizes else ([] if shapes else list(DEFAULT_SIZES))
    dtypes = comma_list(a.dtypes, "--dtypes", ("fp32", "fp16", "bf16"), "dtype")
    batches = batch_sizes(a.batches)
    from core.outputs import REPORT_JSON, check_output_file, write_json
    if a.json:
        check_output_file(a.json, REPORT_JSON)
    import torch
    if not torch.cuda.is_available():
        raise UserError("bench.gpu_decode: expected a CUDA device, found none (torch.cuda.is_available() is False); "
                        "run it on a GPU machine (bash bench/gpu_check.sh) or use python -m bench.decode on a CPU")
    results = run_benchmark(sizes, dtypes, batches, a.prompt, a.steps, a.warmup, a.rounds, a.seed, shapes=shapes)
    if a.json:
        write_json(a.json, results)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
