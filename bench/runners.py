"""What one benchmark round runs: our sessions (runtime/) and the peers a user would run instead.

Every runner has the same two calls, so the rounds can interleave them freely:

    activate()                          load (untimed; RSS growth recorded)
    generate(prompts [B, T], n) -> Timing   greedy, exactly n new tokens per sequence
    profile(prompts, steps) -> dict     share of the decode step spent in norm ops (separate,
                                        after the timed rounds: profiling slows a run down)

    ours        runtime.generate.generate over a runtime session (ort / torch / trt):
                IO-bound in-place KV cache, greedy sampling on the host
    hf          Hugging Face transformers GPT2LMHeadModel.generate(use_cache=True) on an
                equal-shape GPT-2 config (random weights; LayerNorm, gelu_new, tied head)
    ort-plain   a plain ONNX Runtime loop over the rmsnorm-strong graph: numpy feeds each
                step, caches returned as new arrays (TensorScatter copies them)
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.process_memory import rss_bytes


@dataclass
class Timing:
    ttft_s: float
    step_s: list[float]
    total_s: float
    run_s: float | None = None     # of the decode steps' time, the part inside the engine call (None: not split)


class Runner:
    name = "?"
    kind = "ours"           # ours | peer
    weight_bytes = 0
    max_batch: int | None = None   # largest batch it runs (None: any)

    def activate(self) -> None:
        before = rss_bytes([os.getpid()])
        self._activate()
        self.rss_load_bytes = rss_bytes([os.getpid()]) - before

    def _activate(self) -> None: ...

    def generate(self, prompts: np.ndarray, n: int) -> Timing: ...

    def profile(self, prompts: np.ndarray, steps: int) -> dict | None:
        return None

    def close(self) -> None: ...


# --- ours: runtime sessions --------------------------------------------------------------------

class SessionRunner(Runner):
    """runtime.generate over a DecoderSession; `make(profile_dir)` returns an inactive session
    (with ONNX Runtime profiling switched on when profile_dir is given)."""

    def __init__(self, name: str, make, weight_bytes: int, source: str, norm_nodes: dict | None = None):
        self.name, self.make, self.weight_bytes, self.source = name, make, weight_bytes, source
        self.norm_nodes = norm_nodes or {}
        self.session = None

    def _activate(self) -> None:
        self.session = self.make(None).activate()

    def generate(self, prompts, n):
        from runtime.generate import GenerationConfig, generate
        r = generate(self.session, [list(p) for p in prompts], GenerationConfig(max_new_tokens=n))
        ort = self.session.backend == "ort"           # run_s: ONNX Runtime sessions time their own engine calls
        return Timing(r.ttft_s, r.step_s, r.total_s, run_s=float(sum(r.engine_s)) if ort else None)

    def profile(self, prompts, steps):
        """Norm share of the decode step: torch's on this session; ONNX Runtime's on a second session
        of the graph with profiling on (its trace in a temporary directory)."""
        if self.session.backend == "torch":
            return torch_norm_share(self.session, prompts, steps)
        if self.session.backend != "ort":
            return None
        from core.decode import DecodeDriver, greedy_tokens
        with tempfile.TemporaryDirectory() as tmp:
            s = self.make(Path(tmp)).activate()
            try:
                s.reset(prompts.shape[0])
                greedy_tokens(DecodeDriver(s.step, s.spec, prompts.shape[0], owns_caches=True), prompts, steps)
                events = s.profile_events()
            finally:
                s.deactivate()
        return ort_norm_share(events, self.norm_nodes)

    def close(self):
        if self.session is not None:
            self.session.deactivate()


def make_ort_session(path: str, threads: int):
    """Factory for SessionRunner: an OrtSession on the CPU, with ONNX Runtime profiling on (its trace under
    profile_dir, by OrtSession's profile_prefix) when profile_dir is given."""
    from runtime.ort_session import OrtSession

    def make(profile_dir):
        prefix = None if profile_dir is None else Path(profile_dir) / "ort"
        return OrtSession(path, device="cpu", intra_op_threads=threads, profile_prefix=prefix)
    return make


# --- profiles ------------------------------------------------------------------------------------

def ort_norm_share(events: list[dict], norm_nodes: dict[str, str]) -> dict:
    """Share f of node time in norm ops per decode step, from an ONNX Runtime profile.

    The first model_run is the prefill and is dropped. A node counts as a norm when the
    exported graph attributes it to a norm module (`norm_nodes`, by name) or its op type
    is a norm op (ORT may rename nodes it fuses). Per step the last norm node is the
    final norm (ln_f): f_blocks leaves it out. f_run divides by the whole model_run
    (node time plus ORT's per-run overhead) instead of node time.
    """
    from bench.variants import NORM_OP_TYPES
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])[1:]
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    has_final = any(v == "final" for v in norm_nodes.values())
    tot = norm = final = run_time = 0.0
    ops: dict[str, float] = {}
    for run in runs:
        lo, hi = run["ts"], run["ts"] + run["dur"]
        inside = sorted((e for e in nodes if lo <= e["ts"] <= hi), key=lambda e: e["ts"])
        step_norm = []
        for e in inside:
            name = e["name"][: -len("_kernel_time")]
            op = e.get("args", {}).get("op_name", "")
            tot += e["dur"]
            if name in norm_nodes or op in NORM_OP_TYPES:
                step_norm.append(e)
                ops[op] = ops.get(op, 0.0) + e["dur"]
        norm += sum(e["dur"] for e in step_norm)
        if step_norm and has_final:
            final += step_norm[-1]["dur"]
        run_time += run["dur"]
    if not runs or tot <= 0:
        return {"tool": "onnxruntime profiler", "steps": 0}
    return {"tool": "onnxruntime profiler", "steps": len(runs),
            "f": norm / tot, "f_blocks": (norm - final) / tot, "f_run": norm / run_time,
            "node_us_per_step": tot / len(runs), "run_us_per_step": run_time / len(runs),
            "norm_us_per_step": norm / len(runs),
            "norm_us_by_op": {k: v / len(runs) for k, v in sorted(ops.items())}}


# torch 2.13's profiler (kineto) writes `USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start`
# and `profiler_stop` from C++ straight to fd 2 at every start and stop; KINETO_LOG_LEVEL does not
# silence them. A benchmark's output is its progress and results, so those lines are dropped here.
PROFILER_NOISE = re.compile(rb"^(USDT|STAGE):\S+ \S+ \d+:\d+ SyncActivityProfilerHandler\.cpp:\d+\] ")


@contextlib.contextmanager
def profiler_noise_dropped():
    """Native stderr (fd 2) to a temporary file while inside; afterwards every line of it that is
    not kineto's start/stop noise is written back to stderr, so a real warning still shows."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = b"".join(line for line in caught if not PROFILER_NOISE.match(line))
            if kept:
                os.write(2, kept)


def torch_norm_share(session, prompts, steps) -> dict:
    """Share f of the decode step spent inside norm modules, from torch.profiler: each norm
    module's forward is wrapped in record_function('bench.norm.{block|final}') and each
    decode step in 'bench.decode_step'; f = norm time / step time (CPU-side wall)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from bench.variants import NORM_CLASSES
    from core.decode import DecodeDriver
    model = session.model
    handles, open_ = [], {}

    def pre(name):
        def hook(mod, args):
            rf = record_function(name)
            rf.__enter__()
            open_[id(mod)] = rf
        return hook

    def post(mod, args, out):
        rf = open_.pop(id(mod), None)
        if rf is not None:
            rf.__exit__(None, None, None)

    for name, m in model.named_modules():
        is_norm = isinstance(m, NORM_CLASSES) or name.endswith(("ln_1", "ln_2", "ln_f"))
        if is_norm and not isinstance(m, torch.nn.Identity):        # a folded-away norm runs nothing
            handles += [m.register_forward_pre_hook(pre("bench.norm." + ("final" if name.endswith("ln_f") else "block"))),
                        m.register_forward_hook(post)]
    def step(feeds):               # the session's step, marked for the profiler (the session is not patched)
        with record_function("bench.decode_step"):
            return session.step(feeds)
    b, t = prompts.shape
    session.reset(b)
    driver = DecodeDriver(step, session.spec, b, owns_caches=True)
    driver.prefill(prompts)
    try:
        with profiler_noise_dropped(), profile(activities=[ProfilerActivity.CPU]) as prof:
            tok = np.zeros(b, np.int64)
            for k in range(steps):
                tok = driver.decode(tok, np.full(b, t + k, np.int64)).argmax(-1)
    finally:
        for h in handles:
            h.remove()
    tot = {"bench.decode_step": 0.0, "bench.norm.block": 0.0, "bench.norm.final": 0.0}
    for e in prof.events():
        if e.name in tot:
            tot[e.name] += e.cpu_time_total
    step_us = tot["bench.decode_step"]
    if step_us <= 0:
        return {"tool": "torch.profiler", "steps": 0}
    norm = tot["bench.norm.block"] + tot["bench.norm.final"]
    return {"tool": "torch.profiler", "steps": steps, "f": norm / step_us,
            "f_blocks": tot["bench.norm.block"] / step_us, "f_run": norm / step_us,
            "node_us_per_step": step_us / steps, "run_us_per_step": step_us / steps,
            "norm_us_per_step": norm / steps}


# --- peers ---------------------------------------------------------------------------------------

class PlainOrtRunner(Runner):
    """A plain ONNX Runtime loop: session.run with numpy feeds each step, no IO binding."""
    kind = "peer"

    def __init__(self, path: str, threads: int, weight_bytes: int, name: str = "ort-plain"):
        self.name, self.path, self.threads, self.weight_bytes = name, path, threads, weight_bytes

    def _activate(self):
        import onnxruntime as ort
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.log_severity_level = 3     # it would warn every step that the cache is copied
        from core.contract import check_external_data_file
        check_external_data_file(self.path)
        self.sess = ort.InferenceSession(self.path, so, providers=["CPUExecutionProvider"])
        from runtime.model_files import spec_from_ort_session
        self.spec = spec_from_ort_session(self.sess, self.path)

    def generate(self, prompts, n):
        from core.decode import DecodeDriver, graph_step
        b, t = prompts.shape
        graph, run_s = graph_step(self.sess), []

        def step(feeds):             # the engine call, timed: the rest of a step is the loop's own cost
            r0 = time.perf_counter()
            outs = graph(feeds)
            run_s.append(time.perf_counter() - r0)
            return outs
        t0 = time.perf_counter()
        driver = DecodeDriver(step, self.spec, b)
        tok = driver.prefill(prompts)[:, -1].argmax(-1)
        ttft = time.perf_counter() - t0
        steps = []
        for k in range(n - 1):
            s0 = time.perf_counter()
            tok = driver.decode(tok, np.full(b, t + k, np.int64)).argmax(-1)
            steps.append(time.perf_counter() - s0)
        return Timing(ttft, steps, time.perf_counter() - t0, run_s=float(sum(run_s[1:])))     # [0]: the prefill


class HFRunner(Runner):
    """transformers GPT2LMHeadModel.generate(use_cache=True), greedy, exactly n new tokens."""
    kind = "peer"

    def __init__(self, shape: dict, capacity: int, device: str = "cpu", name: str = "hf-generate"):
        self.name, self.shape, self.capacity, self.device = name, shape, capacity, device

    def _activate(self):
        import torch
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel
        transformers.logging.set_verbosity_error()
        d = self.shape["d_model"]
        cfg = GPT2Config(vocab_size=self.shape["vocab_size"], n_positions=self.capacity, n_embd=d,
                         n_layer=self.shape["n_layer"], n_head=self.shape["n_head"], n_inner=4 * d,
                         activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=None, pad_token_id=0)
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(cfg).eval().to(self.device)
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0
        wpe = self.model.transformer.wpe.weight         # parameters() yields the tied head's weight once
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p is not wpe)
        self.impl = getattr(self.model.config, "_attn_implementation", None)

    def generate(self, prompts, n):
        import torch
        times: list[float] = []

        class Stamp:   # transformers' BaseStreamer protocol: put() once for the prompt, then per token
            def put(self, value):
                if self_device_cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter())

            def end(self):
                pass
        self_device_cuda = self.device.startswith("cuda")
        ids = torch.from_numpy(np.ascontiguousarray(prompts, np.int64)).to(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, use_cache=True, streamer=Stamp(), pad_token_id=0)
        total = time.perf_counter() - t0
        new = times[1:]                          # times[0]: the prompt was put
        return Timing(new[0] - t0, list(np.diff(new)), total)

    def close(self):
        self.model = None


def versions() -> dict:
    out = {}
    for mod in ("torch", "onnx", "onnxruntime", "numpy", "transformers", "tensorrt"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            out[mod] = None
    return out


def machine_info(gpu: bool = True) -> dict:
    """The machine a bench runs on (its results' "machine"); gpu=False leaves the CUDA device out
    and torch unimported (bench.serve, bench.scale)."""
    import platform
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        cpuinfo = []
    info = {"cpu": next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?"),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    if gpu:
        info["gpu"] = None
        with contextlib.suppress(Exception):
            import torch
            if torch.cuda.is_available():
                info["gpu"] = torch.cuda.get_device_name(0)
    return {**info, "platform": platform.platform(), "python": platform.python_version(),
            "loadavg_start": list(os.getloadavg())}
