"""python -m bench.serve --url HOST:PORT [--concurrency 1,4,16,32] [--requests N] [--prompts FILE] --out DIR
python -m bench.serve --api openai --url http://127.0.0.1:PORT [--endpoint completions|chat] [--force-length F] ...

A closed-loop load generator for a running Triton server's generate model (gRPC streaming),
on loopback only:

    for each round, for each concurrency level c (in an order rotated each round,
    bench.stats.round_order): c clients, each sending its next request as soon as its
    previous one has finished, until N requests of that level are done; every request
    streams exactly --max-new-tokens tokens (ignore_eos, greedy), the prompts taken in turn
    from --prompts (one per line) or a built-in list

and reports per level (pooled over rounds; tok/s also per round as min/median/max):

    aggregate tok/s      every streamed token / the level's wall time (first send to last token)
    requests/s           completed requests / wall time
    TTFT p50/p90/p99     send -> first token, per request
    ITL p50/p90/p99      gap between consecutive tokens of one request (inter-token latency)
    errors               per first line of the error
    peak server RSS      the process listening on the port and its children (the backend
                         stubs), sampled every 0.1 s
    scheduler counters   with --metrics-url: rows run / rows running, prefill and decode time

into OUT/results.json, OUT/results.md and OUT/serve.png (throughput and p99 latencies vs
concurrency), rewritten after every level, so an interrupted run keeps what it measured.
Untimed warm-up requests (--warmup) run first. The server's model sets the pool size
(`runtime.triton repo --slots`); a level above slots + max_queued sees "server busy" errors.

--api openai drives any OpenAI-compatible server instead (ours with --openai-port, llama.cpp's server,
vLLM) with streamed /v1/completions (or /v1/chat/completions), timed from the SSE chunks, into the same
report, so two servers are read by one client: bench/openai_client.py says how tokens are counted (usage,
else finish_reason "length", else text chunks) and which answers count as errors.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import json
import os
import shlex
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench import stats
from core.errors import ArgumentParser, UsageError, UserError, float_in, int_in
from core.lifecycle import run_cli
from core.outputs import (SERVE_RESULTS, check_output_dir, claim_dir, png_signature_metadata, replace_file_in,
                          replaced_file_in)
from runtime.triton.client import StreamingClient, check_url

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
PROMPTS = [
    "Once upon a time there was a little cat named Tom.",
    "Lily saw a big dog in the park and she smiled at him.",
    "One day the sun was warm and the birds sang in the tall tree near the river.",
    "Tom liked to play",
    "The little girl found a red ball under her bed, and she was very happy because it was her favourite toy.",
    "They were happy friends",
    "Mom said: it is time to go to bed, but first we read a story about a brave bear who lived in the woods.",
    "A boy",
]
DEFAULT_CONCURRENCY = "1,4,16,32"
MAX_CONCURRENCY = 256
MAX_PROMPTS_FILE_BYTES = 1 << 20
RSS_PERIOD_S = 0.1


def default_requests(concurrency: int) -> int:
    """Requests per level and round: four waves of the level's clients, at least 8."""
    return max(8, 4 * concurrency)


def check_loopback(url: str) -> str:
    check_url(url)
    host = url.rpartition(":")[0]
    if host not in LOOPBACK:
        raise UsageError(f"--url {url!r}: expected a server on this machine ({', '.join(LOOPBACK[:3])}), found host "
                         f"{host!r}; bench.serve loads loopback servers only")
    return url


# --- the server's processes ------------------------------------------------------------------------

def listening_pid(port: int) -> int | None:
    """The process that listens on TCP `port` (Linux /proc), or None where it cannot be seen."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:         # no such table (IPv6 off), or no /proc
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:   # 0A: LISTEN
                inodes.add(f[9])
    if not inodes:
        return None
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(fd_dir.parent.name)
        except OSError:
            continue
    return None


class RssMonitor:
    """Peak resident memory of a process tree, sampled in a thread while `with` lasts."""

    def __init__(self, pid: int | None):
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        from runtime.process_memory import process_tree, rss_bytes
        while True:
            self.peak = max(self.peak, rss_bytes(process_tree(self.pid)))
            if self._stop.wait(RSS_PERIOD_S):
                return

    def __enter__(self) -> "RssMonitor":
        if self.pid is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def settled_scheduler_counters(metrics_url: str | None) -> dict[str, float]:
    """scheduler_counters once they stop moving. The model publishes its counters every
    METRICS_PERIOD_S, so a read right after a level can miss its last steps (and count them in
    the next level): at ~1500 tok/s a 4-request level lasts about two periods. Read until two
    reads a period apart agree (the pool is idle between levels); at most 20 periods."""
    if metrics_url is None:
        return {}
    from runtime.triton.python_model import METRICS_PERIOD_S
    now = scheduler_counters(metrics_url)
    for _ in range(20):
        time.sleep(1.5 * METRICS_PERIOD_S)
        then, now = now, scheduler_counters(metrics_url)
        if now == then:
            break
    return now


def scheduler_counters(metrics_url: str) -> dict[str, float]:
    """The generate model's counters summed over instances (runtime/triton/python_model.py METRICS)."""
    import urllib.request
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tapernorm_generate_") and "_total" in line:
            name = line.split("{")[0][len("tapernorm_generate_"):].removesuffix("_total")
            if 'reason="' in line:
                name += "." + line.split('reason="')[1].split('"')[0]
            out[name] = out.get(name, 0.0) + float(line.rpartition(" ")[2])
    return out


# --- one level -------------------------------------------------------------------------------------

def run_level(url: str, concurrency: int, requests: int, prompts: list[str], max_new_tokens: int,
              model: str, timeout_s: float) -> dict:
    """c closed-loop clients until `requests` are done: raw per-request timings."""
    from bench.openai_client import closed_loop      # the one closed loop, shared with --api openai

    def one(client: StreamingClient, i: int, k: int) -> dict:
        arrivals: list[float] = []
        t0 = time.perf_counter()
        error = None
        try:
            client.generate(prompts[i % len(prompts)], max_new_tokens, ignore_eos=True,
                            on_piece=lambda text, tokens: arrivals.extend([time.perf_counter()] * len(tokens)))
        except Exception as e:  # noqa: BLE001 - counted and reported, the load goes on
            error = str(e).split("\n")[0]
        return {"client": k, "sent": t0, "arrivals": arrivals, "error": error}
    return closed_loop(concurrency, requests, lambda: StreamingClient(url, model=model, timeout_s=timeout_s), one)


def round_tokens_per_s(level: dict) -> float:
    """Aggregate tokens/s of one round of one level: every streamed token / (first send to last token)."""
    span = level["end"] - level["start"]
    return sum(len(x["arrivals"]) for x in level["records"]) / span if span > 0 else float("nan")


def summarize_level(raw: list[dict], concurrency: int) -> dict:
    """Figures of one level from its rounds' raw timings."""
    ttft, itl, errors = [], [], Counter()
    tokens = ok = 0
    for r in raw:
        for rec in r["records"]:
            a = rec["arrivals"]
            tokens += len(a)
            if rec["error"]:
                errors[rec["error"]] += 1
                continue
            ok += 1
            if a:
                ttft.append(a[0] - rec["sent"])
                itl += [y - x for x, y in zip(a, a[1:])]
    wall = sum((r["end"] - r["start"] for r in raw), 0.0)
    counted = Counter(rec["counted_by"] for r in raw for rec in r["records"] if "counted_by" in rec)

    def pct(xs):
        return {f"p{q}_ms": stats.percentile(xs, q) * 1e3 for q in (50, 90, 99)}
    return {"concurrency": concurrency, "rounds": len(raw), "requests": sum(len(r["records"]) for r in raw),
            "completed": ok, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
            "tokens_per_s_rounds": stats.Spread.of(map(round_tokens_per_s, raw)).as_dict(),
            "requests_per_s": ok / wall if wall > 0 else float("nan"),
            "ttft": pct(ttft), "itl": pct(itl), "errors": dict(errors),
            **({"tokens_counted_by": dict(counted)} if counted else {})}    # --api openai: bench/openai_client.py


# --- reports ---------------------------------------------------------------------------------------

def _f(x, nd=1) -> str:
    return "-" if x is None or x != x else f"{x:.{nd}f}"


def _api_words(settings: dict) -> str:
    if settings.get("api") != "openai":
        return ""
    return f" (OpenAI /v1/{'chat/' if settings['endpoint'] == 'chat' else ''}completions, streamed)"


def markdown(results: dict) -> str:
    s = results["settings"]
    lines = [f"# bench.serve: {results['started']}", "",
             f"`{results['command']}`", "",
             f"Server {s['url']}{_api_words(s)} model `{s['model']}`; {s['max_new_tokens']} new tokens per request "
             f"(greedy, {s.get('force_length', 'ignore_eos')}), {len(s['prompts'])} prompts in turn, {s['rounds']} round(s), levels interleaved; "
             f"machine {results['machine'].get('cpu', '?')}, load average "
             f"{' '.join(f'{x:.2f}' for x in results['machine']['loadavg_start'])} (start) / "
             f"{' '.join(f'{x:.2f}' for x in results['machine'].get('loadavg_end', []))} (end).", "",
             "| concurrency | requests | tok/s | tok/s per round (min / median / max) | req/s | TTFT p50 / p90 / p99 ms "
             "| ITL p50 / p90 / p99 ms | errors | peak server RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lv in results["levels"]:
        r, t, i = lv["tokens_per_s_rounds"], lv["ttft"], lv["itl"]
        lines.append(f"| {lv['concurrency']} | {lv['completed']}/{lv['requests']} | {_f(lv['tokens_per_s'])} | "
                     f"{_f(r['min'])} / {_f(r['median'])} / {_f(r['max'])} | {_f(lv['requests_per_s'], 2)} | "
                     f"{_f(t['p50_ms'])} / {_f(t['p90_ms'])} / {_f(t['p99_ms'])} | "
                     f"{_f(i['p50_ms'])} / {_f(i['p90_ms'])} / {_f(i['p99_ms'])} | "
                     f"{sum(lv['errors'].values())} | {_f(lv['peak_rss_bytes'] / 2**20, 0) if lv['peak_rss_bytes'] else '-'} |")
    if results.get("ratios"):
        lines += ["", "Aggregate tok/s over concurrency 1, per round (median [min, max]): " + ", ".join(
            f"c{c}: {_f(v['median'], 2)}x [{_f(v['min'], 2)}, {_f(v['max'], 2)}]" for c, v in results["ratios"].items())]
    counted = sum((Counter(lv.get("tokens_counted_by", {})) for lv in results["levels"]), Counter())
    if counted:
        lines += ["", "Output tokens of a request counted from: " + ", ".join(
            f"{how} ({n} requests)" for how, n in counted.most_common()) + " (usage: the server's usage; length: "
            "max_tokens, the stream ended with finish_reason length and no usage; chunks: text chunks)."]
    sched = [lv for lv in results["levels"] if lv.get("scheduler")]
    if sched:
        lines += ["", "Scheduler (server counters over each level): rows running / rows run per decode step; "
                  "share of the scheduler's busy time spent in prefills.", "",
                  "| concurrency | decode steps | rows running per step | rows run per step | prefill share |",
                  "|---|---|---|---|---|"]
        for lv in sched:
            c = lv["scheduler"]
            steps = c.get("decode_steps", 0)
            busy = c.get("prefill_seconds", 0) + c.get("decode_seconds", 0)
            lines.append(f"| {lv['concurrency']} | {steps:.0f} | {_f(c.get('rows_running', 0) / steps if steps else None, 2)} "
                         f"| {_f(c.get('rows_run', 0) / steps if steps else None, 2)} | "
                         f"{_f(100 * c.get('prefill_seconds', 0) / busy if busy else None, 1)}% |")
    errors = sum((Counter(lv["errors"]) for lv in results["levels"]), Counter())
    if errors:
        lines += ["", "Errors:"] + [f"- {n} x {msg}" for msg, n in errors.most_common()]
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    levels = results["levels"]
    cs = [lv["concurrency"] for lv in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    tps = [lv["tokens_per_s"] for lv in levels]
    lo = [lv["tokens_per_s"] - lv["tokens_per_s_rounds"]["min"] for lv in levels]
    hi = [lv["tokens_per_s_rounds"]["max"] - lv["tokens_per_s"] for lv in levels]
    left.errorbar(cs, tps, yerr=[lo, hi], marker="o", capsize=3)
    left.set(xscale="log", xlabel="concurrent clients", ylabel="aggregate tokens/s", title="throughput (min-max of rounds)")
    right.plot(cs, [lv["itl"]["p99_ms"] for lv in levels], marker="o", label="inter-token p99")
    right.plot(cs, [lv["ttft"]["p99_ms"] for lv in levels], marker="s", label="TTFT p99")
    right.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms", title="p99 latency")
    for ax in (left, right):
        ax.set_xticks(cs, [str(c) for c in cs])
    right.legend()
    fig.suptitle(f"bench.serve {results['started']}, {results['settings']['max_new_tokens']} new tokens per request",
                 fontsize=9)
    fig.tight_layout()
    with replaced_file_in(out, "serve.png") as tmp:
        fig.savefig(tmp, dpi=110, format="png", metadata=png_signature_metadata())
    plt.close(fig)
    return out / "serve.png"


# --- CLI -------------------------------------------------------------------------------------------

def _parser():
    p = ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[1])
    p.add_argument("--url", required=True, help="HOST:PORT of the server's gRPC endpoint, on this machine "
                                                "(--api openai: http://HOST:PORT of its OpenAI routes)")
    p.add_argument("--api", choices=("triton", "openai"), default="triton",
                   help="triton: the generate model over gRPC streaming (default); openai: any OpenAI-compatible "
                        "server, streamed over HTTP")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="--api openai: /v1/completions (default) or /v1/chat/completions")
    p.add_argument("--force-length", choices=("ignore_eos", "min_tokens", "both", "none"), default="ignore_eos",
                   help="--api openai: the request field(s) that make a server generate exactly --max-new-tokens: "
                        "ignore_eos (ours, vLLM, llama.cpp's llama-server; default) or min_tokens "
                        "(llama-cpp-python's server)")
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                   help=f"comma list of concurrent clients, each in [1, {MAX_CONCURRENCY}] (default {DEFAULT_CONCURRENCY})")
    p.add_argument("--requests", type=int_in(1, 100_000), help="requests per level and round (default: 4 x concurrency, at least 8)")
    p.add_argument("--prompts", help=f"UTF-8 text file, one prompt per line (at most {MAX_PROMPTS_FILE_BYTES >> 20} MiB); "
                                     "default: a built-in list of 8 prompts of 2 to 30 words")
    p.add_argument("--max-new-tokens", type=int_in(1, 100_000), default=64, help="tokens per request (default 64)")
    p.add_argument("--rounds", type=int_in(1, 100), default=1, help="rounds, levels interleaved (default 1)")
    p.add_argument("--warmup", type=int_in(0, 1000), default=2, help="untimed requests first (default 2)")
    p.add_argument("--model", help="the server's generate model (default generate); --api openai: the request's "
                                   "model field (default: the first of the server's GET /v1/models)")
    p.add_argument("--metrics-url", help="HOST:PORT of the server's metrics (runtime.triton serve --metrics-port): "
                                         "scheduler counters per level")
    p.add_argument("--timeout", type=float_in(0.1, 86_400.0), default=600.0, help="seconds one request may take")
    p.add_argument("--out", required=True, help="results directory (results.json, results.md, serve.png)")
    return p


def parse_levels(value: str) -> list[int]:
    """--concurrency's comma list (distinct levels in [1, MAX_CONCURRENCY]), or UsageError."""
    try:
        levels = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(not 1 <= c <= MAX_CONCURRENCY for c in levels) or len(set(levels)) != len(levels):
        raise UsageError(f"--concurrency {value!r}: expected a comma list of distinct integers in [1, {MAX_CONCURRENCY}], "
                         f"e.g. {DEFAULT_CONCURRENCY}")
    return levels


def read_prompts(path: str | None) -> list[str]:
    """--prompts' lines (the non-blank ones), or the built-in PROMPTS without a file."""
    from core.inputs import read_text_file
    if path is None:
        return list(PROMPTS)
    lines = [ln for ln in read_text_file(path, "--prompts", MAX_PROMPTS_FILE_BYTES).split("\n") if ln.strip()]
    if not lines:
        raise UserError(f"--prompts {path}: expected one prompt per line, found none; add some")
    return lines


@dataclass
class ServeRun:
    """What a bench.serve run has measured so far, per concurrency level; results.json is written
    from it after every level (JSON only at the file)."""
    out: Path
    started: str
    command: str
    machine: dict
    pid: int | None
    settings: dict
    levels: list[int]
    raw: dict = field(default_factory=dict)         # level -> [run_level() records of each round]
    peak: dict = field(default_factory=dict)        # level -> peak server RSS, bytes
    counters: dict = field(default_factory=dict)    # level -> scheduler counters' increments

    def results(self) -> dict:
        self.machine["loadavg_end"] = list(os.getloadavg())
        done = [c for c in self.levels if self.raw.get(c)]
        summaries = []
        for c in done:
            lv = summarize_level(self.raw[c], c)
            lv["peak_rss_bytes"] = self.peak.get(c) or None
            lv["scheduler"] = self.counters.get(c) or None
            summaries.append(lv)
        tps = {c: [round_tokens_per_s(r) for r in self.raw[c]] for c in done}
        n = {c: min(len(tps[c]), len(tps[1])) for c in done if c != 1 and 1 in done}     # the rounds both ran
        ratios = {c: stats.ratio_summary(tps[c][:k], tps[1][:k]).as_dict() for c, k in n.items()}
        return {"format": 1, "started": self.started, "command": self.command, "machine": self.machine,
                "server_pid": self.pid, "settings": self.settings, "levels": summaries, "ratios": ratios,
                # per request: sent (s after the round's start), TTFT and last token (s after sent), tokens, error
                "requests": {c: [[{"sent": round(x["sent"] - r["start"], 6), "tokens": len(x["arrivals"]),
                                   "ttft": round(x["arrivals"][0] - x["sent"], 6) if x["arrivals"] else None,
                                   "last": round(x["arrivals"][-1] - x["sent"], 6) if x["arrivals"] else None,
                                   "error": x["error"]} for x in r["records"]] for r in self.raw[c]] for c in done}}

    def write(self) -> None:
        results = self.results()
        replace_file_in(self.out, "results.json", json.dumps(results, indent=1) + "\n")
        replace_file_in(self.out, "results.md", markdown(results))
        if results["levels"]:
            plot({**results, "levels": sorted(results["levels"], key=lambda lv: lv["concurrency"])}, self.out)


def run(argv: list[str] | None = None) -> int:
    from bench.runners import machine_info
    args = _parser().parse_args(argv)
    if args.api == "openai":
        return _run_openai(args, argv)
    args.model = args.model or "generate"
    url = check_loopback(args.url)
    if args.metrics_url is not None:
        check_loopback(args.metrics_url)
    levels = parse_levels(args.concurrency)
    prompts = read_prompts(args.prompts)
    check_output_dir(args.out, SERVE_RESULTS)          # refused before any load, nothing written
    with StreamingClient(url, model=args.model, timeout_s=args.timeout) as client:   # reachable? refused early
        for i in range(max(1, args.warmup)):
            client.generate(prompts[i % len(prompts)], args.max_new_tokens, ignore_eos=True)
    settings = {"url": url, "model": args.model, "concurrency": levels,
                "requests": {c: args.requests or default_requests(c) for c in levels},
                "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "warmup": args.warmup, "prompts": prompts}
    sr = ServeRun(claim_dir(args.out, SERVE_RESULTS), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                  "python -m bench.serve " + shlex.join(sys.argv[1:] if argv is None else argv),
                  machine_info(gpu=False), listening_pid(int(url.rpartition(":")[2])), settings, levels)
    print(f"bench.serve: {url} levels {levels}, {args.rounds} round(s), {args.max_new_tokens} new tokens per request; "
          f"server pid {sr.pid if sr.pid is not None else 'not visible (no RSS)'}", flush=True)
    for r in range(args.rounds):
        for c in stats.round_order(levels, r):
            measure_level(sr, c, r, args.metrics_url, lambda c=c: run_level(
                url, c, settings["requests"][c], prompts, args.max_new_tokens, args.model, args.timeout))
    print(f"wrote {sr.out / 'results.json'}, {sr.out / 'results.md'} and {sr.out / 'serve.png'}")
    return 0


def _run_openai(args, argv: list[str] | None) -> int:
    """run() for --api openai: the same levels, rounds, report and outputs over bench.openai_client."""
    from bench import openai_client
    from bench.runners import machine_info
    _, port, _ = openai_client.split_url(args.url)
    if args.metrics_url is not None:
        check_loopback(args.metrics_url)
    levels = parse_levels(args.concurrency)
    prompts = read_prompts(args.prompts)
    check_output_dir(args.out, SERVE_RESULTS)          # refused before any load, nothing written
    model = args.model or openai_client.served_model(args.url)     # none where /v1/models names none
    kw = dict(model=model, endpoint=args.endpoint, force_length=args.force_length, timeout_s=args.timeout)
    openai_client.warm_up(args.url, prompts, args.max_new_tokens, args.warmup, **kw)   # reachable? refused early
    settings = {"url": args.url, "api": "openai", "endpoint": args.endpoint, "force_length": args.force_length,
                "model": model, "concurrency": levels,
                "requests": {c: args.requests or default_requests(c) for c in levels},
                "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "warmup": args.warmup, "prompts": prompts}
    sr = ServeRun(claim_dir(args.out, SERVE_RESULTS), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                  "python -m bench.serve " + shlex.join(sys.argv[1:] if argv is None else argv),
                  machine_info(gpu=False), listening_pid(port), settings, levels)
    print(f"bench.serve: {args.url} (OpenAI {args.endpoint}) levels {levels}, {args.rounds} round(s), "
          f"{args.max_new_tokens} new tokens per request; "
          f"server pid {sr.pid if sr.pid is not None else 'not visible (no RSS)'}", flush=True)
    for r in range(args.rounds):
        for c in stats.round_order(levels, r):
            measure_level(sr, c, r, args.metrics_url, lambda c=c: openai_client.run_level(
                args.url, c, settings["requests"][c], prompts, args.max_new_tokens, **kw))
    print(f"wrote {sr.out / 'results.json'}, {sr.out / 'results.md'} and {sr.out / 'serve.png'}")
    return 0


def measure_level(sr: ServeRun, c: int, r: int, metrics_url: str | None, run_one) -> dict:
    """One level of one round: run_one() under the RSS monitor and the scheduler counters, kept in sr,
    a line printed and the outputs rewritten."""
    before = settled_scheduler_counters(metrics_url)
    with RssMonitor(sr.pid) as rss:
        level = run_one()
    after = settled_scheduler_counters(metrics_url)
    totals = sr.counters.setdefault(c, {})
    for k, v in after.items():
        totals[k] = totals.get(k, 0.0) + v - before.get(k, 0.0)
    sr.peak[c] = max(sr.peak.get(c, 0), rss.peak)
    sr.raw.setdefault(c, []).append(level)
    lv = summarize_level([level], c)
    print(f"  round {r + 1} c={c}: {lv['completed']}/{lv['requests']} requests, {lv['tokens_per_s']:.1f} tok/s, "
          f"TTFT p99 {lv['ttft']['p99_ms']:.0f} ms, ITL p99 {lv['itl']['p99_ms']:.0f} ms, "
          f"{sum(lv['errors'].values())} errors", flush=True)
    sr.write()
    return level


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
