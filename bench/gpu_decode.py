"""python -m bench.gpu_decode [--sizes 1M,8M,30M,124M] [--dtypes fp32,bf16] [--batches 1,8] [--json FILE]

The paper's headline on a GPU: decode steps with a KV cache, RMSNorm baseline vs the
norm-free tapered models with their scales folded, on the `torch` backend with CUDA
graphs (runtime.torch_session: one captured graph per batch size, replayed each step).

    variants   rmsnorm-strong (F.rms_norm, gamma folded), internal-taper-fused,
               all-taper-fused (bench/variants.py: zoo weights where the shape fits, random else)
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

from core.errors import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import copy
import functools
import time

import numpy as np

from bench import stats
from core.errors import ArgumentParser, UsageError, UserError, int_in, run_cli, seed_int

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


def run_benchmark(sizes, dtypes, batches, prompt: int, steps: int, warmup: int, rounds: int, seed: int,
                  log=print, device: str = "cuda") -> dict:
    """Every (size, dtype, batch) cell; device="cpu" runs the same code without CUDA graphs (tests)."""
    import torch

    from bench.variants import VARIANTS, base_model, capacity_for, torch_variant, weight_bytes_torch
    from runtime.torch_session import TorchSession
    capacity = capacity_for(prompt, warmup + steps + 1)
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else None
    results = {"device": gpu or device, "torch": torch.__version__, "cuda": torch.version.cuda,
               "prompt": prompt, "steps": steps, "warmup": warmup, "rounds": rounds, "capacity": capacity,
               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cells": []}
    names = (BASELINE, *FUSED)
    for size in sizes:
        base = functools.cache(lambda kind, size=size: base_model(size, kind, capacity, seed))    # once per kind
        models = {n: torch_variant(VARIANTS[n], base(VARIANTS[n].kind)[0]) for n in names}
        sources = {n: base(VARIANTS[n].kind)[1] for n in names}
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


def _csv(value: str, known, what: str) -> list[str]:
    """The items of a comma list, each one of `known`; UsageError naming the option otherwise."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in known]
    if not items or bad:
        raise UsageError(f"--{what} {value!r}: expected a comma list of {', '.join(known)}, found "
                         f"{', '.join(bad) or 'nothing'}; pass e.g. --{what} {','.join(list(known)[:2])}")
    return items


def _batches(value: str) -> list[int]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if not (v.isascii() and v.isdigit() and 1 <= int(v) <= 256)]
    if not items or bad:
        raise UsageError(f"--batches {value!r}: expected a comma list of batch sizes in [1, 256], found "
                         f"{', '.join(bad) or 'nothing'}; pass e.g. --batches 1,8")
    return [int(v) for v in items]


def run(argv: list[str]) -> int:
    from bench.variants import SIZES
    p = ArgumentParser(prog="python -m bench.gpu_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"comma list of {', '.join(SIZES)}")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, fp16, bf16")
    p.add_argument("--batches", default="1,8", help="comma list of batch sizes in [1, 256]")
    p.add_argument("--prompt", type=int_in(1, 4096), default=16)
    p.add_argument("--steps", type=int_in(1, 100_000), default=128, help="timed decode steps per round")
    p.add_argument("--warmup", type=int_in(1, 100_000), default=16)
    p.add_argument("--rounds", type=int_in(3, 1000), default=5, help="interleaved rounds, >= 3")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of random weights where no zoo model fits")
    p.add_argument("--json", help="also write the results here (a JSON report)")
    a = p.parse_args(argv)
    sizes = _csv(a.sizes, SIZES, "sizes")
    dtypes = _csv(a.dtypes, ("fp32", "fp16", "bf16"), "dtypes")
    batches = _batches(a.batches)
    from core.outputs import REPORT_JSON, check_output_file, write_json
    if a.json:
        check_output_file(a.json, REPORT_JSON)
    import torch
    if not torch.cuda.is_available():
        raise UserError("bench.gpu_decode: expected a CUDA device, found none (torch.cuda.is_available() is False); "
                        "run it on a GPU machine (bash bench/gpu_check.sh) or use python -m bench.decode on a CPU")
    results = run_benchmark(sizes, dtypes, batches, a.prompt, a.steps, a.warmup, a.rounds, a.seed)
    if a.json:
        write_json(a.json, results)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.errors import exit_after
    exit_after(main())
