"""The `generate` model of the repository: a decoupled Triton Python-backend model over the
batch scheduler (runtime/scheduler.py) and a decode session of the backend its config names
(parameter decode_backend: trt runs the repository's engine decoder_trt/1/model.plan, ort-cuda
and ort-cpu its graph with ONNX Runtime; `open_decode_session`). It logs which at initialize,
and a backend that cannot load here fails initialize with one line naming it and the fix.

One request is one prompt: inputs prompt (BYTES [1]) and, optional, max_new_tokens,
temperature, top_k, top_p, seed, ignore_eos, stream ([1] each). Outputs text (BYTES [1]) and
tokens (INT64 [n]). Defaults are runtime.generate's: greedy, seed 0, stop at <|endoftext|>
when the tokenizer has it, max_new_tokens from the config's parameters (32).

    stream false (default)  one response: the whole text and every new token (a stop token
                            included), as runtime.generate returns them
    stream true             one response per new token: the text it adds (possibly "" while a
                            UTF-8 character is incomplete, or for a stop token) and [token];
                            the last one carries the final flag. The texts concatenated are
                            the non-streamed text.

Transaction policy decoupled: `execute` only queues requests and returns; one scheduler
per model instance (one backend process, one decode session whose caches are the slot pool)
serves every request of every execute call, and its loop thread sends the responses.
A request the model cannot serve gets one error response (INVALID_ARG with the runtime's
one-line message; UNAVAILABLE "server busy: ..." when the pool and its queue are full); a
cancelled request or a disconnected client frees its slot within one step.

Metrics (Prometheus, when the server runs with metrics on), per instance: gauges
tapernorm_generate_running and _waiting (the pool now), counters of finished sequences by
reason, busy refusals, decode steps, rows run and rows running, seconds in prefill and
decode (METRICS).

`ResponseStream` and `TextStream` are the backend-free core (tests call them directly).
"""
from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import numpy as np

from runtime.generate import GenerationConfig, default_stop_tokens
from runtime.sampling import SamplingConfig
from runtime.scheduler import CANCELLED, ERROR, BatchScheduler, ServerBusy
from runtime.session import RuntimeUserError

METRICS_PERIOD_S = 0.1
# Prometheus metrics of each instance: (name, kind, description, labels, value from (running, waiting, stats))
METRICS = [
    ("tapernorm_generate_running", "GAUGE", "sequences holding a cache slot", {}, lambda r, w, s: r),
    ("tapernorm_generate_waiting", "GAUGE", "sequences queued for a slot", {}, lambda r, w, s: w),
    *[("tapernorm_generate_finished_total", "COUNTER", "sequences finished, by reason", {"reason": why},
       lambda r, w, s, why=why: s.finished[why]) for why in ("stop", "length", "cancelled", "error")],
    ("tapernorm_generate_refused_busy_total", "COUNTER", "requests refused with server busy", {},
     lambda r, w, s: s.refused_busy),
    ("tapernorm_generate_decode_steps_total", "COUNTER", "decode steps run", {}, lambda r, w, s: s.steps),
    ("tapernorm_generate_rows_run_total", "COUNTER", "rows the decode steps computed", {}, lambda r, w, s: s.rows_run),
    ("tapernorm_generate_rows_running_total", "COUNTER", "of those, rows holding a running sequence", {},
     lambda r, w, s: s.rows_running),
    ("tapernorm_generate_prefill_seconds_total", "COUNTER", "time in prefills (the running batch waits)", {},
     lambda r, w, s: s.prefill_s),
    ("tapernorm_generate_decode_seconds_total", "COUNTER", "time in decode steps", {}, lambda r, w, s: s.decode_s),
]


@dataclass(frozen=True)
class Request:
    prompt: str
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    stream: bool = False


class TextStream:
    """Text of a growing token list, handed out in pieces whose concatenation is the text
    runtime.generate prints (stop tokens left out). Byte-level tokens can split a UTF-8
    character: the decoder shows an incomplete one as U+FFFD, so trailing U+FFFD is held
    back until a later token completes it (or the sequence ends)."""

    def __init__(self, tokenizer, stop: tuple[int, ...]):
        self.tokenizer, self.stop = tokenizer, frozenset(stop)
        self.ids: list[int] = []
        self.sent = ""

    def text(self) -> str:
        return self.tokenizer.decode(self.ids)

    def push(self, token: int, last: bool = False) -> str:
        """The text `token` adds (everything left, with last=True)."""
        if token not in self.stop:
            self.ids.append(token)
        text = self.text()
        ready = text if last else text.rstrip("\ufffd")
        if not ready.startswith(self.sent):      # the decoder revised text already sent: hold until the end
            return ""
        piece, self.sent = ready[len(self.sent):], ready
        return piece


class ResponseStream:
    """What one request's client receives, from the scheduler's events (see the module docstring).

    send(text, tokens, error, final): text str | None, tokens list[int] | None, error an exception
    or None; final True on the last response. Triton's response sender sits behind it."""

    def __init__(self, send: Callable, tokenizer, stop: tuple[int, ...], stream: bool):
        self.send, self.stream = send, stream
        self.text = TextStream(tokenizer, stop)

    def on_event(self, seq, token: int | None) -> None:
        last = seq.finish is not None
        if token is None:                          # ended without a token: cancelled, error, shutdown
            if seq.finish == ERROR:
                self.send(None, None, RuntimeError(seq.error), True)
            elif seq.finish == CANCELLED:
                self.send(None, None, None, True)   # nobody may be listening; close the request
            return
        if self.stream:
            self.send(self.text.push(token, last), [token], None, last)
        elif last:
            for t in seq.tokens:
                self.text.push(t)
            self.send(self.text.text(), list(seq.tokens), None, True)


def open_decode_session(model_dir: Path, params: dict[str, str]):
    """The generate model's active decode session, as its config's parameters name it (decode_backend,
    a key of repository.GENERATE_BACKENDS; ort-cpu where absent: a repository written before it),
    and the line it logs. A backend that cannot load here raises one RuntimeUserError line."""
    from runtime.backends import open_session
    from runtime.triton.repository import ENGINE_PLAN, GENERATE_BACKENDS
    choice = params.get("decode_backend", "ort-cpu")
    if choice not in GENERATE_BACKENDS:
        raise RuntimeUserError(f"generate/config.pbtxt: decode_backend {choice!r}: expected one of "
                               f"{', '.join(GENERATE_BACKENDS)}; write the repository again with python -m runtime.triton repo")
    name, device = GENERATE_BACKENDS[choice]
    engine = model_dir.parent.parent / params.get("engine", ENGINE_PLAN)      # <repo>/decoder_trt/1/model.plan
    try:
        if name == "trt":
            session = open_session(name, engine.with_name("source.onnx"), device, engine=engine).activate()
            what = f"TensorRT engine {engine}"
        else:
            session = open_session(name, model_dir, device,
                                   intra_op_threads=int(params.get("intra_op_threads", 0))).activate()
            what = f"ONNX Runtime {session.session.get_providers()[0]}, {session.path}"
    except RuntimeUserError as e:
        raise RuntimeUserError(f"generate: decode backend {choice} cannot load here ({e}); fix that, or write the "
                               "repository with python -m runtime.triton repo --generate-backend ort-cpu") from None
    return session, f"generate: decoding with {choice} ({what})"


class TritonPythonModel:
    """Triton Python-backend entry points: initialize, execute, finalize."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils
        from runtime.model_files import load_tokenizer
        from runtime.triton.repository import DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_QUEUED, DEFAULT_SLOTS
        self.pb = pb_utils
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise RuntimeUserError("generate/config.pbtxt: expected model_transaction_policy { decoupled: true }, "
                                   "found it off; write the repository again with python -m runtime.triton repo")
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.default_max_new_tokens = int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
        model_dir = Path(args["model_repository"]) / args["model_version"]
        self.session, line = open_decode_session(model_dir, params)
        if hasattr(pb_utils, "Logger"):           # Triton's log (the Python backend's Logger, 23.x and later)
            pb_utils.Logger.log_info(line)
        else:
            print(line, file=sys.stderr, flush=True)
        self.tokenizer = load_tokenizer(model_dir, self.session.spec.vocab_size)
        self.scheduler = BatchScheduler(self.session, slots=int(params.get("slots", DEFAULT_SLOTS)),
                                        max_queued=int(params.get("max_queued", DEFAULT_MAX_QUEUED))).start()
        self._stop_metrics = threading.Event()
        self._metrics = threading.Thread(target=self._report_pool, args=(args.get("model_instance_name", "0"),),
                                         name="pool-metrics", daemon=True)
        self._metrics.start()

    def _report_pool(self, instance: str) -> None:
        """Publish the pool gauges and the scheduler's counters every METRICS_PERIOD_S (see METRICS)."""
        pb = self.pb
        try:    # a family must outlive its metrics: keep both
            families, metrics = [], []
            for name, kind, text, labels, _ in METRICS:
                families.append(pb.MetricFamily(name=name, description=text, kind=getattr(pb.MetricFamily, kind)))
                metrics.append(families[-1].Metric(labels={"instance": instance, **labels}))
            last = [0.0] * len(METRICS)
            while not self._stop_metrics.wait(METRICS_PERIOD_S):
                running, waiting = self.scheduler.pool()
                stats = self.scheduler.stats()
                for i, (name, kind, _, _, read) in enumerate(METRICS):
                    value = float(read(running, waiting, stats))
                    if kind == "GAUGE":
                        metrics[i].set(value)
                    elif value > last[i]:
                        metrics[i].increment(value - last[i])
                    last[i] = value
        except Exception:  # noqa: BLE001 - metrics off or unsupported: serving goes on without them
            return

    def _scalar(self, request, name: str, default):
        t = self.pb.get_input_tensor_by_name(request, name)
        if t is None:
            return default
        a = t.as_numpy()
        if a.size != 1:
            raise RuntimeUserError(f"input {name}: expected one value (shape [1]), found shape {list(a.shape)}")
        return a.reshape(-1)[0]

    def _request(self, request) -> Request:
        raw = self._scalar(request, "prompt", None)
        if raw is None:
            raise RuntimeUserError("input prompt: expected a BYTES tensor of shape [1], found none")
        try:
            prompt = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError:
            raise RuntimeUserError("input prompt: expected UTF-8 text, found undecodable bytes") from None
        defaults = {f.name: f.default for f in fields(Request) if f.name != "prompt"}
        defaults["max_new_tokens"] = self.default_max_new_tokens
        # each optional input, or its default, as the type of that default (int, float, bool)
        return Request(prompt, **{n: type(d)(self._scalar(request, n, d)) for n, d in defaults.items()})

    def _sender(self, request) -> Callable:
        pb = self.pb
        sender = request.get_response_sender()

        def send(text, tokens, error, final):
            flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
            if error is not None:
                sender.send(pb.InferenceResponse(error=self._error(error)), flags=flags)
            elif text is None:
                sender.send(flags=flags)
            else:
                sender.send(pb.InferenceResponse(output_tensors=[
                    pb.Tensor("text", np.array([text.encode("utf-8")], dtype=np.object_)),
                    pb.Tensor("tokens", np.array(tokens, dtype=np.int64))]), flags=flags)
        return send

    def _error(self, e: Exception):
        pb = self.pb
        user = isinstance(e, RuntimeUserError)             # a ServerBusy is one too
        kind = "UNAVAILABLE" if isinstance(e, ServerBusy) else "INVALID_ARG"
        code = getattr(pb.TritonError, kind, None) if user else None
        msg = str(e) if user or str(e).startswith("internal error") else f"internal error: {type(e).__name__}: {e}"
        return pb.TritonError(msg, code) if code is not None else pb.TritonError(msg)

    def execute(self, requests):
        for request in requests:
            send = self._sender(request)
            try:
                req = self._request(request)
                # its sampling settings are checked by submit ("sampling: ...; fix the request")
                config = GenerationConfig(max_new_tokens=req.max_new_tokens, seed=req.seed,
                                          sampling=SamplingConfig(req.temperature, req.top_k, req.top_p),
                                          stop_tokens=default_stop_tokens(self.tokenizer, req.ignore_eos))
                stream = ResponseStream(send, self.tokenizer, config.stop_tokens, req.stream)
                self.scheduler.submit(self.tokenizer.encode(req.prompt).ids, config, listener=stream.on_event,
                                      cancelled_by=request.is_cancelled)
            except Exception as e:  # one bad request must not take the model down
                send(None, None, e, True)
        return None

    def finalize(self) -> None:
        self._stop_metrics.set()
        self.scheduler.close()
        self.session.deactivate()
