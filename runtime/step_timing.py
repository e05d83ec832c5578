"""Per-step timing of a session's decode step, and where the time goes outside the engine call.

    python -m runtime.step_timing --model build/dyt [--backend ort] [--batch 1] [--steps 200]
    python -m runtime.step_timing --model A --model B --backend torch --device cuda   # side by side, interleaved

For ort it splits each decode step into the time inside InferenceSession.run_with_iobinding
(the session's own last_inference_time) and the rest (the driver's feeds, writing
tokens/positions into the bound buffers, checks, returning the logits view): the per-step
overhead outside session.run (docs/runtime.md). The steps are driven by core.decode.
For other backends it reports the decode step as a whole. Warm-up steps are not timed;
models given together are timed in rounds, interleaved, so a noisy machine hits all alike.
This is a quick runtime-level check; bench/ owns the benchmark reports.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import time

import numpy as np

from core.decode import DecodeDriver
from core.errors import ArgumentParser, int_in, positive_int
from core.lifecycle import run_cli
from runtime.session import DecoderSession, RuntimeUserError


def time_decode_steps(session: DecoderSession, batch: int = 1, prompt_len: int = 8, steps: int = 100,
                      warmup: int = 10) -> dict[str, np.ndarray]:
    """Seconds per decode step: {'step': [n]} and for ort also {'run': [n], 'outside': [n]}."""
    cap = session.spec.capacity
    steps = min(steps, cap - prompt_len - warmup)
    if steps < 1 or prompt_len > cap:
        raise RuntimeUserError(f"step timing: expected capacity > prompt_len + warmup, found capacity {cap}; "
                               "use a shorter --prompt-len")
    session.reset(batch)
    driver = DecodeDriver(session.step, session.spec, batch, owns_caches=True)
    rng = np.random.default_rng(0)
    driver.prefill(rng.integers(0, session.spec.vocab_size, (batch, prompt_len)))
    tokens = rng.integers(0, session.spec.vocab_size, batch)
    positions = [np.full(batch, prompt_len + i, np.int64) for i in range(warmup + steps)]
    split = session.backend == "ort"
    step = np.zeros(steps)
    run = np.zeros(steps)
    for i, pos in enumerate(positions):
        t0 = time.perf_counter()
        driver.decode(tokens, pos)
        dt = time.perf_counter() - t0
        if i >= warmup:
            step[i - warmup] = dt
            run[i - warmup] = session.last_inference_time() if split else dt
    out = {"step": step}
    if split:
        out["run"], out["outside"] = run, step - run
    return out


def summarize(times: dict[str, np.ndarray]) -> str:
    return "; ".join(f"{k} p50 {np.percentile(v, 50) * 1e6:.1f} us (min {v.min() * 1e6:.1f}, max {v.max() * 1e6:.1f})"
                     for k, v in times.items())


def run(argv: list[str]) -> int:
    p = ArgumentParser(prog="python -m runtime.step_timing", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, help="repeat to time several models interleaved")
    p.add_argument("--backend", default="ort")
    p.add_argument("--device", default=None)
    p.add_argument("--batch", type=int_in(1, 4096), default=1)
    p.add_argument("--prompt-len", type=positive_int, default=8)
    p.add_argument("--steps", type=int_in(1, 1_000_000), default=100)
    p.add_argument("--rounds", type=int_in(1, 1000), default=3)
    args = p.parse_args(argv)
    from runtime.backends import open_session
    sessions = [open_session(args.backend, m, device=args.device).activate() for m in args.model]
    results: dict[str, dict[str, list]] = {m: {} for m in args.model}
    for _ in range(args.rounds):
        for m, s in zip(args.model, sessions):
            for k, v in time_decode_steps(s, args.batch, args.prompt_len, args.steps).items():
                results[m].setdefault(k, []).append(v)
    for m, s in zip(args.model, sessions):
        merged = {k: np.concatenate(v) for k, v in results[m].items()}
        print(f"{args.backend} {s.spec.dtype} batch {args.batch} {m}: {summarize(merged)}")
        s.deactivate()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
