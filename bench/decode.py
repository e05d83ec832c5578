"""python -m bench.decode [--quick] [--sizes 1M,8M,...] [--backends ort,torch,...] --out DIR

Decode throughput of the deployed variants (bench/variants.py) side by side, with the
peers a user would run instead (bench/runners.py), gpt-fast style:

    1. measure the machine's memory read bandwidth (np.max over 1 GiB on one and on --threads
       threads, and a BLAS matrix-vector product; best of 5)
    2. build every variant's ONNX once into OUT/cache (export.pipeline's stages, each graph verified
       as export.build verifies it unless --no-verify)
    3. per (size, backend) one worker process: load every runner, then per batch size
       one untimed warm-up generation each, then ROUNDS rounds in which every runner
       generates once, in an order rotated each round (bench.stats.round_order);
       then a profiled decode of every runner (norm share f, after the timed rounds)
    4. OUT/results.json (raw timings, summary, machine, versions, command),
       OUT/results.md and OUT/*.png (bench.report; `python -m bench.report OUT` redoes them)

Timings are greedy generations of exactly --new-tokens tokens from random prompts of
--prompt tokens; tokens/s = batch x new tokens / (TTFT + decode steps).
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import contextlib
import functools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import timeit
from argparse import SUPPRESS
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench import stats
from bench.genai import PRECISIONS, GenAIRunner, build_genai, build_ours_genai, genai_status
from bench.options import batch_sizes, comma_list
from bench.runners import HFRunner, PlainOrtRunner, SessionRunner, machine_info, make_ort_session, versions
from bench.variants import (BASELINE, SIZES, VARIANTS, GraphInfo, base_model, build_onnx, capacity_for, config_for,
                            quantized_name, torch_variant, weight_bytes_torch)
from core.errors import ArgumentParser, UsageError, float_in, int_in, nonnegative_int, seed_int
from core.lifecycle import run_cli
from core.outputs import (BENCH_CACHE, BENCH_RESULTS, check_output_dir, claim_dir, marker_kind, replace_file_in,
                          write_marker)
from runtime.process_memory import peak_rss_bytes

ONNX_BACKENDS = ("ort", "trt")
ALL_BACKENDS = ("ort", "torch", "torch-cuda", "trt")
PEERS = ("hf-generate", "ort-plain", "genai")
DTYPES = ("fp32", "int8", "int4")


# --- machine ----------------------------------------------------------------------------------

def read_bandwidth(gib: float = 1.0, repeats: int = 5, threads: int = 1) -> dict[str, float]:
    """The machine's memory read bandwidth in bytes/s, best of `repeats`, by three read-only
    kernels over one float32 array of `gib` GiB: np.max (SIMD, one thread), np.max split over
    `threads` threads (numpy releases the GIL), and a BLAS matrix-vector product (the decode
    step's own kernel; BLAS's thread count). np.sum is not used: its pairwise summation is
    compute-bound below the memory bandwidth. 'best' is the largest."""
    from concurrent.futures import ThreadPoolExecutor
    a = np.ones((int(gib * 2**30) // 4096, 1024), np.float32)                  # [rows, 1024]
    x = np.ones(1024, np.float32)
    parts = np.array_split(a, threads)

    def best_of(fn) -> float:
        return a.nbytes / min(timeit.repeat(fn, number=1, repeat=repeats))     # perf_counter, best call
    out = {"max_1thread": best_of(a.max)}
    if threads > 1:                  # (one thread: the same measurement as max_1thread)
        with ThreadPoolExecutor(threads) as pool:
            out[f"max_{threads}threads"] = best_of(lambda: list(pool.map(np.max, parts)))
    out["gemv_blas"] = best_of(lambda: a @ x)
    out["best"] = max(out.values())
    return out


def backend_status(name: str) -> str | None:
    """None when the backend can run here, else why not."""
    if name in ("ort", "torch"):
        return None
    try:
        import torch
        cuda = torch.cuda.is_available()
    except Exception:
        cuda = False
    if not cuda:
        return "no CUDA device (torch.cuda.is_available() is False)"
    if name == "trt":
        import importlib.util
        if importlib.util.find_spec("tensorrt") is None:
            return "tensorrt is not installed (pip install 'tapernorm-deploy[tensorrt]')"
    return None


# --- worker: one (size, backend) per process ---------------------------------------------------------

@dataclass
class WorkerSpec:
    """What one worker process runs: one (size, backend) cell of the run's settings. It crosses the
    process boundary as JSON (to_json / from_json) and is typed on both sides."""
    size: str
    backend: str
    settings: Settings
    onnx: dict[str, GraphInfo]          # runner name -> built graph (bench.variants.build_onnx)
    genai: dict[str, dict]              # GenAI peers' infos (bench.genai)

    def to_json(self) -> dict:
        return {**asdict(self), "onnx": {k: v.to_json() for k, v in self.onnx.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "WorkerSpec":
        return cls(**{**data, "settings": Settings(**data["settings"]),
                      "onnx": {k: GraphInfo.from_json(v) for k, v in data["onnx"].items()}})


def onnx_runners(spec: WorkerSpec) -> list:
    """Our runners over the built graphs (quantized graphs, com.microsoft MatMulNBits, on ONNX Runtime only)."""
    s = spec.settings
    dtypes = s.dtypes if spec.backend == "ort" else ["fp32"]
    names = [quantized_name(n, d) for n in s.variants for d in dtypes if quantized_name(n, d) in spec.onnx]
    out = []
    for name in names:
        info = spec.onnx[name]
        if spec.backend == "ort":
            make = make_ort_session(info.path, s.threads)
        else:
            from runtime.backends import open_session
            make = lambda pd, p=info.path: open_session("trt", p)  # noqa: E731
        out.append(SessionRunner(name, make, info.weight_bytes, info.source, info.norm_nodes))
    return out


def torch_runners(spec: WorkerSpec) -> list:
    """Our runners on torch eager: each variant's model (bench.variants.torch_variant)."""
    from runtime.torch_session import TorchSession
    device = "cuda" if spec.backend == "torch-cuda" else "cpu"
    s, out = spec.settings, []
    base = functools.cache(lambda kind: base_model(spec.size, kind, s.capacity, s.seed))    # once per kind
    for name in s.variants:
        model, source = base(VARIANTS[name].kind)
        m = torch_variant(VARIANTS[name], model)
        out.append(SessionRunner(name, lambda pd, m=m: TorchSession(m, device=device), weight_bytes_torch(m), source))
    return out


def peer_runners(spec: WorkerSpec) -> list:
    """The peers beside our ONNX backends (and torch-cuda on a GPU); on CPU once, in the ort worker."""
    device = "cuda" if spec.backend in ("torch-cuda", "trt") else "cpu"
    s, out = spec.settings, []
    peers = s.cell_peers(spec.backend)
    if "hf-generate" in peers:
        out.append(HFRunner(SIZES[spec.size], s.capacity, device=device))
    if "ort-plain" in peers:
        info = spec.onnx[BASELINE]
        out.append(PlainOrtRunner(info.path, s.threads, info.weight_bytes))
    if "genai" in peers:
        out += [GenAIRunner(info, s.threads) for info in spec.genai.values()]
    return out


def timed_rounds(runners, prompts: np.ndarray, n: int, rounds: int, log=None) -> tuple[dict, list]:
    """One untimed warm-up generation per runner, then `rounds` rounds in which every runner
    generates once, in the order round_order(names, r). Returns (per-runner rounds and pooled
    decode-step times, the order actually run)."""
    batch = prompts.shape[0]
    runners = [r for r in runners if getattr(r, "max_batch", None) is None or batch <= r.max_batch]
    names = [r.name for r in runners]
    by_name = {r.name: r for r in runners}
    for r in runners:
        r.generate(prompts, n)
    cell = {name: {"rounds": [], "step_s": []} for name in names}
    order = []
    for rnd in range(rounds):
        order.append(stats.round_order(names, rnd))
        for name in order[-1]:
            t = by_name[name].generate(prompts, n)
            cell[name]["rounds"].append({"ttft_s": t.ttft_s, "total_s": t.total_s, "decode_s": float(sum(t.step_s)),
                                         "steps": len(t.step_s), "run_s": t.run_s})
            cell[name]["step_s"] += [round(s, 7) for s in t.step_s]
        if log:
            log(f"round {rnd + 1}/{rounds} tokens/s: " + ", ".join(
                f"{k} {batch * n / cell[k]['rounds'][-1]['total_s']:.0f}" for k in names))
    return cell, order


def batch_cell(spec: WorkerSpec, runners: list, batch: int) -> dict:
    """One batch size: the timed rounds, then a profiled decode of each of our runners."""
    s = spec.settings
    prompts = np.random.default_rng(batch).integers(0, SIZES[spec.size]["vocab_size"], (batch, s.prompt))
    label = f"{spec.size} {spec.backend} b{batch}"
    cell, order = timed_rounds(runners, prompts, s.new_tokens, s.rounds,
                               log=lambda msg: print(f"    {label} {msg}", flush=True))
    for r in runners:
        if r.kind == "ours" and s.profile_steps > 0:
            try:
                cell[r.name]["profile"] = r.profile(prompts, s.profile_steps)
            except Exception as e:   # a profiler failure must not lose the timings
                cell[r.name]["profile"] = {"error": f"{type(e).__name__}: {e}"}
    return {"order": order, "runners": cell}


def worker(spec: WorkerSpec) -> dict:
    """The cell's raw timings (JSON: the worker process's answer)."""
    import torch
    torch.set_num_threads(spec.settings.threads)
    t_start = time.perf_counter()
    ours = onnx_runners(spec) if spec.backend in ONNX_BACKENDS else torch_runners(spec)
    runners = ours + peer_runners(spec)
    loaded = {}
    for r in runners:
        r.activate()
        loaded[r.name] = {"kind": r.kind, "weight_bytes": r.weight_bytes, "rss_load_bytes": r.rss_load_bytes,
                          "source": getattr(r, "source", None), "impl": getattr(r, "impl", None)}
    batches = {str(b): batch_cell(spec, runners, b) for b in spec.settings.batches}
    for r in runners:
        r.close()
    return {"size": spec.size, "backend": spec.backend, "runners": loaded, "batches": batches,
            "peak_rss_bytes": peak_rss_bytes(), "wall_s": round(time.perf_counter() - t_start, 1)}


def run_worker(spec: WorkerSpec, workdir: Path) -> dict:
    """Run `worker(spec)` in a fresh process (its own peak RSS, no state shared between cells)."""
    spec_path = workdir / f"spec-{spec.size}-{spec.backend}.json"
    out_path = spec_path.with_name(spec_path.name.replace("spec-", "cell-"))
    replace_file_in(workdir, spec_path.name, json.dumps(spec.to_json()))
    cmd = [sys.executable, "-m", "bench.decode", "--worker", str(spec_path), "--worker-out", str(out_path)]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode != 0 or not out_path.is_file():
        return {"size": spec.size, "backend": spec.backend, "error": f"worker exited with status {proc.returncode}"}
    return json.loads(out_path.read_text())


# --- builds -------------------------------------------------------------------------------------------

@dataclass
class Builds:
    """What the build step made: graphs and GenAI peers per size, and its wall time."""
    onnx: dict[str, dict[str, GraphInfo]]       # size -> runner name -> graph
    genai: dict[str, dict[str, dict]]           # size -> peer name -> bench.genai info
    seconds: float = 0.0


def _build_task(args):
    size, names, cap, cache, seed, dtypes, attention, verify = args
    return size, build_onnx(size, names, cap, Path(cache), seed, dtypes=dtypes, attention=attention, verify=verify)


def build_genai_all(sizes, dtypes, cap, cache: Path, seed: int, verify: bool = True) -> tuple[dict, dict]:
    """Per size and dtype GenAI has (fp32, int4): GenAI's own build and GenAI's folder of our folded
    graph (bench.genai.build_ours_genai); ({size: {runner name: info}}, {what: why not} for what
    could not be built)."""
    out, skipped = {s: {} for s in sizes}, {}
    for size in sizes:
        for precision in [d for d in dtypes if d in PRECISIONS]:
            for name, make in ((f"genai-{precision}", lambda: build_genai(size, SIZES[size], cap, precision, cache, seed)),
                               (f"genai-ours-{precision}",
                                lambda: build_ours_genai(size, cap, precision, cache, seed, verify=verify))):
                try:
                    out[size][name] = make()
                except Exception as e:      # a peer that cannot be built is skipped, with the reason
                    skipped[f"{name} {size}"] = str(e).splitlines()[0][:300]
    for d in dtypes:
        if d not in PRECISIONS:
            skipped[f"genai-{d}"] = f"the GenAI builder's CPU precisions are {', '.join(PRECISIONS)}"
    return out, skipped


def build_all(s: Settings, cache: Path, jobs: int) -> dict[str, dict[str, GraphInfo]]:
    """ONNX for every (size, variant) of the run, `jobs` export processes at a time; grouped by model
    (Variant.model_key) so internal-taper's unfused and fused graphs share one export."""
    import multiprocessing as mp
    by_model: dict[tuple, list[str]] = {}
    for n in s.variants:
        by_model.setdefault(VARIANTS[n].model_key, []).append(n)
    groups = [(size, g, s.capacity, str(cache), s.seed, list(s.dtypes), s.attention, s.verify)
              for size in s.sizes for g in by_model.values()]
    out: dict[str, dict] = {size: {} for size in s.sizes}
    # a pool's exit terminates the workers, also on Ctrl-C; one job: no pool, in this process
    with mp.get_context("spawn").Pool(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        for size, infos in (pool.imap_unordered if pool else map)(_build_task, groups):
            out[size].update(infos)
        if pool:
            # done: let the workers exit on their own, so what they hold (the verification's libraries
            # create semaphores) is released; terminate() would leave them to the resource tracker
            pool.close()
            pool.join()
    return out


def build_models(s: Settings, cache: Path, jobs: int) -> Builds:
    """Every graph the cells need (ONNX only for an ONNX backend; the GenAI peers when asked)."""
    t0 = time.perf_counter()
    need_onnx = any(b in ONNX_BACKENDS for b in s.backends)
    builds = Builds(build_all(s, cache, jobs) if need_onnx else {size: {} for size in s.sizes},
                    {size: {} for size in s.sizes})
    if "genai" in s.peers:
        builds.genai, why_not = build_genai_all(s.sizes, s.dtypes, s.capacity, cache, s.seed, s.verify)
        s.skipped_backends.update(why_not)
    builds.seconds = time.perf_counter() - t0
    print(f"  builds ready in {builds.seconds:.0f} s", flush=True)
    return builds


# --- CLI -------------------------------------------------------------------------------------------

def _parser():
    p = ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n\n")[1])
    p.add_argument("--out", type=Path, help="results directory (results.json, results.md, *.png, cache/)")
    p.add_argument("--quick", action="store_true", help="sizes 1M,8M; ort+torch; batch 1; 32 new tokens; 3 rounds")
    p.add_argument("--sizes", help=f"comma list of {', '.join(SIZES)} (default: all; quick: 1M,8M)")
    p.add_argument("--variants", help=f"comma list of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--backends", help=f"comma list of {', '.join(ALL_BACKENDS)} (default: those available here)")
    p.add_argument("--peers", help=f"comma list of {', '.join(PEERS)}, or none (default: hf-generate,ort-plain; "
                                   "genai needs onnxruntime-genai)")
    p.add_argument("--dtypes", help=f"comma list of {', '.join(DTYPES)}: weight dtypes of the fused variants "
                                    "(int8/int4: export.quantize, ort only; default fp32)")
    p.add_argument("--batches", help="comma list of batch sizes in [1, 256] (default 1,8; quick: 1)")
    p.add_argument("--attention", choices=("plain", "fused", "gqa"), default=None,
                   help="ONNX graphs with plain attention ops, one fused Attention op per layer, or ONNX Runtime's "
                        "GroupQueryAttention with Q/K/V in one MatMul (default: the graph export.build writes by "
                        "default here, export/target.py: gqa, or plain where the trt backend runs)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="build without export's checks (each graph against torch, a quantized one against its fp32 "
                        "graph with the dtype's tolerance and top-1 floor); the output and results.json say so")
    p.add_argument("--prompt", type=int_in(1, 4096), default=16, help="prompt tokens (default 16)")
    p.add_argument("--new-tokens", type=int_in(2, 8192), help="new tokens per sequence (default 128; quick: 32)")
    p.add_argument("--rounds", type=int_in(3, 1000), help="timed rounds, >= 3 (default 3)")
    p.add_argument("--capacity", type=int_in(2, 65536), default=None,
                   help="KV-cache capacity of the graphs (default: prompt + new tokens rounded up to 32); "
                        "e.g. to time fewer tokens on graphs already built for more")
    p.add_argument("--threads", type=int_in(1, 256), default=1,
                   help="intra-op threads for ORT and torch (default 1: see docs/bench.md)")
    p.add_argument("--profile-steps", type=nonnegative_int, default=16, help="decode steps profiled per runner (0: no profile)")
    p.add_argument("--cache", type=Path, help="where built ONNX files go (default OUT/cache; reused when built by this code)")
    p.add_argument("--jobs", type=int_in(1, 64), default=2, help="parallel ONNX export processes (default 2)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of random weights where no zoo model fits")
    p.add_argument("--bandwidth-gib", type=float_in(0.01, 64.0), default=1.0, help="array size of the bandwidth measure")
    p.add_argument("--build-only", action="store_true", help="only build the ONNX files into --cache, then exit")
    p.add_argument("--list", action="store_true", help="print sizes (parameters) and variants, and exit")
    p.add_argument("--worker", type=Path, help=SUPPRESS)
    p.add_argument("--worker-out", type=Path, help=SUPPRESS)
    return p


@dataclass
class Settings:
    """One run's settings: the command line's, with the defaults filled in and what this machine
    cannot run taken out (`skipped_backends`: what -> why). to_json() is results.json's "settings":
    the fields in this order, but bandwidth_gib."""
    sizes: list[str]
    variants: list[str]
    backends: list[str]
    skipped_backends: dict[str, str]
    peers: list[str]
    batches: list[int]
    prompt: int
    new_tokens: int
    rounds: int
    threads: int
    capacity: int
    profile_steps: int
    quick: bool
    seed: int
    dtype: str              # the activations': fp32
    dtypes: list[str]
    attention: str
    verify: bool
    bandwidth_gib: float

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "bandwidth_gib"}

    def cell_peers(self, backend: str) -> list[str]:
        return [p for p in self.peers if (p == "hf-generate" and backend != "torch") or
                (p in ("ort-plain", "genai") and backend == "ort")]


def unavailable(wanted: list[str], peers: list[str]) -> dict[str, str]:
    """What of the asked backends and peers cannot run here, and why (peers are taken out of `peers`)."""
    import importlib.util
    skipped = {b: why for b in wanted if (why := backend_status(b)) is not None}
    if "hf-generate" in peers and importlib.util.find_spec("transformers") is None:
        peers.remove("hf-generate")
        skipped["hf-generate"] = "transformers is not installed (pip install 'tapernorm-deploy[hf]')"
    if "genai" in peers:
        why = genai_status() or (None if "ort" in wanted else "genai runs beside the ort backend, not asked for")
        if why:
            peers.remove("genai")
            skipped["genai"] = why
    return skipped


def settings_from(args) -> Settings:
    """The command line's lists and defaults (--quick's among them), checked; what cannot run here left out."""
    q = args.quick
    names = comma_list(args.variants, "--variants", VARIANTS, "variant", list(VARIANTS))
    if BASELINE not in names:
        names.insert(0, BASELINE)   # every ratio is taken against it
    wanted = comma_list(args.backends, "--backends", ALL_BACKENDS, "backend", ["ort", "torch"] if q else list(ALL_BACKENDS))
    peers = [] if args.peers == "none" else comma_list(args.peers, "--peers", PEERS, "peer", ["hf-generate", "ort-plain"])
    skipped = unavailable(wanted, peers)
    backends = [b for b in wanted if b not in skipped]
    sizes = comma_list(args.sizes, "--sizes", SIZES, "size", ["1M", "8M"] if q else list(SIZES))
    new_tokens = args.new_tokens or (32 if q else 128)
    cap = args.capacity or capacity_for(args.prompt, new_tokens)
    if cap < args.prompt + new_tokens:
        raise UsageError(f"--capacity {cap}: expected at least --prompt + --new-tokens = {args.prompt + new_tokens}; "
                         "raise it or drop it")
    return Settings(sizes=sizes, variants=names, backends=backends, skipped_backends=skipped, peers=peers,
                    batches=batch_sizes(args.batches, default=["1"] if q else ["1", "8"]), prompt=args.prompt,
                    new_tokens=new_tokens, rounds=args.rounds or 3, threads=args.threads, capacity=cap,
                    profile_steps=args.profile_steps, quick=q, seed=args.seed, dtype="fp32",
                    dtypes=comma_list(args.dtypes, "--dtypes", DTYPES, "dtype", ["fp32"]),
                    attention=args.attention or default_attention(backends, sizes),
                    verify=args.verify, bandwidth_gib=args.bandwidth_gib)


def default_attention(backends: list[str], sizes: list[str]) -> str:
    """The graph export.build writes by default (--target auto, export/target.py) for every size here;
    the portable one when the trt backend is timed (TensorRT does not take GroupQueryAttention)."""
    from export.target import resolve_target
    from models.decoder import DecoderConfig
    if "trt" in backends:
        return "plain"
    targets = {resolve_target("auto", None, True, "fp32", False, DecoderConfig(**SIZES[s])) for s in sizes}
    return "gqa" if {t.attention for t in targets} == {"gqa"} else "plain"


def claim_outputs(args) -> tuple[Path, Path]:
    """(results directory, build cache), both checked before either is created: nothing half-written."""
    if args.cache is not None:
        check_output_dir(args.cache, BENCH_CACHE, option="--cache")
    out = claim_dir(args.out, BENCH_RESULTS)
    if args.cache is not None:
        return out, claim_dir(args.cache, BENCH_CACHE, option="--cache")
    cache = out / "cache"               # inside our results directory: ours, marked so a later --cache reuses it
    cache.mkdir(exist_ok=True)
    if marker_kind(cache) is None:
        write_marker(cache, BENCH_CACHE)
    return out, cache


@dataclass
class Run:
    """What a run has measured so far; results.json is written from it after every cell."""
    settings: Settings
    command: str
    out: Path
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    t_start: float = field(default_factory=time.perf_counter)
    machine: dict = field(default_factory=dict)
    bandwidth: dict = field(default_factory=dict)        # read_bandwidth's, at the start (and end_ at the end)
    builds: Builds | None = None
    cells: list[dict] = field(default_factory=list)

    @property
    def planned(self) -> list[str]:
        return [f"{size} {backend}" for size in self.settings.sizes for backend in self.settings.backends]

    def results(self, complete: bool) -> dict:
        """results.json's content (format 1; bench.report adds the summary)."""
        s, b = self.settings, self.builds
        return {
            "format": 1, "started": self.started, "wall_s": round(time.perf_counter() - self.t_start, 1),
            "build_s": round(b.seconds, 1), "command": self.command, "complete": complete,
            "cells_planned": self.planned, "ended": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "machine": self.machine, "versions": versions(), "read_bandwidth_Bps": self.bandwidth,
            "settings": s.to_json(),
            "models": {size: {n: {k: getattr(i, k) for k in MODEL_FIELDS} for n, i in b.onnx[size].items()}
                       for size in s.sizes},
            "genai_models": b.genai, "cells": self.cells}

    def write(self, complete: bool) -> None:
        """results.json + reports with the cells done so far (an interrupted run keeps them)."""
        from bench.report import write_reports
        self.machine["loadavg_end"] = list(os.getloadavg())
        if complete:     # bandwidth again at the end: other jobs on a shared machine move it
            bw = self.bandwidth
            end = read_bandwidth(self.settings.bandwidth_gib, 5, self.settings.threads)
            bw.update({f"end_{k}": v for k, v in end.items() if k != "best"})
            bw["best"] = max(v for k, v in bw.items() if k != "best")
        write_reports(self.results(complete), self.out)


# what results.json keeps of each built graph ("verified": export's checks, None under --no-verify)
MODEL_FIELDS = ("source", "params", "weight_bytes", "nodes", "op_counts", "build_s", "verified")


def cell_spec(run: Run, size: str, backend: str) -> WorkerSpec:
    return WorkerSpec(size, backend, run.settings, run.builds.onnx[size], run.builds.genai[size])


def run_cells(run: Run) -> None:
    """Every (size, backend) cell in its own worker process, results written after each."""
    s = run.settings
    with tempfile.TemporaryDirectory(dir=run.out) as work:
        for size in s.sizes:
            for backend in s.backends:
                print(f"  {size} {backend}: {len(s.variants)} variants + peers {s.cell_peers(backend) or 'none'}",
                      flush=True)
                run.cells.append(run_worker(cell_spec(run, size, backend), Path(work)))
                run.write(complete=len(run.cells) == len(run.planned))
    if not run.cells:
        run.write(complete=True)


def list_models() -> None:
    from models.decoder import Decoder
    import torch
    for s in SIZES:
        torch.manual_seed(0)
        print(f"{s:5s} {SIZES[s]}  {Decoder(config_for(s, 'baseline', 160)).num_params():,} params (capacity 160)")
    for v in VARIANTS.values():
        print(f"{v.name:24s} kind {v.kind}{', ' + v.transform if v.transform else ''}{', fused' if v.fuse else ''}")


def main(argv=None) -> int:
    return run_cli(run, argv)


def run(argv) -> int:
    args = _parser().parse_args(argv)
    if args.worker:         # the process boundary: a WorkerSpec in, the cell's timings out, as JSON
        result = worker(WorkerSpec.from_json(json.loads(args.worker.read_text())))
        replace_file_in(args.worker_out.parent, args.worker_out.name, json.dumps(result))
        return 0
    if args.list:
        list_models()
        return 0
    if args.out is None:
        raise UsageError("python -m bench.decode: --out DIR is required (where results.json, results.md and the plots go)")
    s = settings_from(args)
    out, cache = claim_outputs(args)
    command = "python -m bench.decode " + shlex.join(sys.argv[1:] if argv is None else argv)
    r = Run(s, command, out)
    print(f"bench.decode: sizes {s.sizes}, backends {s.backends}, batches {s.batches}, prompt {s.prompt}, "
          f"{s.new_tokens} new tokens, {s.rounds} rounds, {s.threads} threads, {s.attention} attention; "
          f"skipped {s.skipped_backends or 'none'}", flush=True)
    if not s.verify:
        print("  verification OFF (--no-verify): no graph is checked against torch, nor a quantized one against its "
              "fp32 graph; results.json says settings.verify false", flush=True)
    r.machine = machine_info()
    r.bandwidth = read_bandwidth(s.bandwidth_gib, 5, s.threads)
    print("  read bandwidth: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in r.bandwidth.items()), flush=True)
    r.builds = build_models(s, cache, args.jobs)
    if args.build_only:
        return 0
    run_cells(r)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'} and plots in {time.perf_counter() - r.t_start:.0f} s")
    return 0


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
