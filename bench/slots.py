"""python -m bench.slots --model BUILD [--slots 16] [--prompt 32] [--threads 2] [--rounds 5] [--json FILE]

What a newcomer's prefill costs the batch scheduler (runtime/scheduler.py), against the two
other ways to keep it from corrupting the other slots, on one ORT session over BUILD:

    row       prefill_rows(slot, ids [1, T]): the prompt alone in its own row (the scheduler's way)
    pool      prefill([slots, T]) with the other rows pointed at scratch positions: the work of
              the whole pool, whatever it computes for the other rows
    separate  a second session at batch 1 (its own copy of the weights): prefill there, then copy
              positions [0, T) of every cache into the pool's row
    decode    decode_rows over 1 row vs over all slots (why steps run on rows [0, hi) only)

Each round times every variant once, in an order rotated each round (bench.stats.round_order),
after an untimed warm-up; min / median / max over rounds, in ms. The resident memory the
second session adds is read from /proc/self/status around its activation. Prints a Markdown
table; --json writes the figures (a signed JSON file).
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import os
import shlex
import sys
import time
import timeit

import numpy as np

from bench import stats
from core.errors import ArgumentParser, int_in
from core.lifecycle import run_cli


def measure(model: str, slots: int, prompt: int, threads: int, rounds: int) -> dict:
    from runtime.process_memory import rss_bytes
    from runtime.ort_session import OrtSession
    from runtime.session import RuntimeUserError
    pool = OrtSession(model, intra_op_threads=threads).activate()
    spec = pool.spec
    if prompt + 1 > spec.capacity:
        raise RuntimeUserError(f"--prompt {prompt}: expected at most {spec.capacity - 1} tokens (the cache capacity "
                               f"of {model} minus one), found {prompt}; use a shorter prompt")
    pool.reset(slots)
    before = rss_bytes([os.getpid()])
    alone = OrtSession(model, intra_op_threads=threads).activate()
    alone.reset(1)
    second_session = rss_bytes([os.getpid()]) - before
    rng = np.random.default_rng(0)
    ids = rng.integers(0, spec.vocab_size, (1, prompt))                                      # [1, T]
    ids_pool = rng.integers(0, spec.vocab_size, (slots, prompt))                             # [slots, T]
    row = slots // 2
    names = spec.cache_names()

    def separate():
        alone.prefill(ids)
        for n in names:          # positions [0, T) of the batch-1 cache into the pool's row
            pool.cache_array(n)[row, :, :prompt] = alone.cache_array(n)[0, :, :prompt]
    variants = {
        "row": lambda: pool.prefill_rows(row, ids),
        "pool": lambda: pool.prefill(ids_pool),
        "separate": separate,
        "decode_1_row": lambda: pool.decode_rows(0, ids[0, :1], np.array([prompt])),
        "decode_all_rows": lambda: pool.decode_rows(0, ids_pool[:, 0], np.full(slots, prompt)),
    }
    for fn in variants.values():
        fn()                                                  # warm-up, untimed
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds):
        for name in stats.round_order(list(variants), r):
            times[name].append(timeit.timeit(variants[name], number=1))
    alone.deactivate()
    pool.deactivate()
    return {"ms": {k: {q: v * 1e3 for q, v in stats.Spread.of(t).as_dict().items()} for k, t in times.items()},
            "second_session_rss_bytes": second_session, "cache_bytes_per_slot": spec.cache_bytes(1)}


def markdown(result: dict) -> str:
    s = result["settings"]
    ms = result["ms"]
    fmt = lambda k: " / ".join(f"{ms[k][q]:.1f}" for q in ("min", "median", "max"))  # noqa: E731
    return "\n".join([
        f"`{result['command']}` ({result['date']}; load average "
        f"{' '.join(f'{x:.2f}' for x in result['loadavg']['start'])} at the start, "
        f"{' '.join(f'{x:.2f}' for x in result['loadavg']['end'])} at the end)", "",
        f"| {s['slots']} slots, {s['prompt']}-token prompt, {s['threads']} threads, {s['rounds']} rounds | ms min / median / max |",
        "|---|---|",
        f"| prefill in its own row (prefill_rows) | {fmt('row')} |",
        f"| prefill over the whole pool [{s['slots']}, {s['prompt']}] | {fmt('pool')} |",
        f"| separate batch-1 session + row copy | {fmt('separate')} |",
        f"| decode step, 1 row | {fmt('decode_1_row')} |",
        f"| decode step, {s['slots']} rows | {fmt('decode_all_rows')} |",
        "", f"The second session of the separate design adds {result['second_session_rss_bytes'] / 2**20:.0f} MiB of "
            f"resident memory; one slot's caches take {result['cache_bytes_per_slot'] / 2**20:.1f} MiB.", ""])


def _parser():
    p = ArgumentParser(prog="python -m bench.slots", description=__doc__.split("\n\n")[1].split("\n")[0])
    p.add_argument("--model", required=True, help="build directory or .onnx file (the ort backend, CPU)")
    p.add_argument("--slots", type=int_in(2, 256), default=16, help="slots of the pool (default 16)")
    p.add_argument("--prompt", type=int_in(1, 8192), default=32, help="prompt tokens (default 32)")
    p.add_argument("--threads", type=int_in(0, 256), default=2, help="ORT intra-op threads (default 2; 0: ORT's default)")
    p.add_argument("--rounds", type=int_in(3, 1000), default=5, help="timed rounds, >= 3 (default 5)")
    p.add_argument("--json", help="also write the figures to this JSON file (replaces only a file it wrote)")
    return p


def run(argv: list[str] | None = None) -> int:
    from core.outputs import check_output_file, REPORT_JSON, write_json
    args = _parser().parse_args(argv)
    if args.json is not None:
        check_output_file(args.json, REPORT_JSON, inputs=[args.model])     # refused before the measurement
    loadavg = list(os.getloadavg())
    result = measure(args.model, args.slots, args.prompt, args.threads, args.rounds)
    result.update(settings={"slots": args.slots, "prompt": args.prompt, "threads": args.threads, "rounds": args.rounds},
                  command="python -m bench.slots " + shlex.join(sys.argv[1:] if argv is None else argv),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  loadavg={"start": loadavg, "end": list(os.getloadavg())})
    print(markdown(result))
    if args.json is not None:
        write_json(args.json, result, REPORT_JSON, inputs=[args.model])
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
