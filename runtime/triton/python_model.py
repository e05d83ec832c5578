"""The `generate` model of the repository: a decoupled Triton Python-backend model over the
batch scheduler (runtime/scheduler.py) and a decode session of the backend its config names
(parameter decode_backend: trt runs the repository's engine decoder_trt/1/model.plan, ort-cuda
and ort-cpu its graph with ONNX Runtime; `open_decode_session`). It logs which at initialize,
and a backend that cannot load here fails initialize with one line naming it and the fix.

One request is one prompt, in the tensors of Triton's LLM conventions (runtime/triton/llm_tensors.py,
what Triton's OpenAI frontend and its generate extension send): text_input (BYTES [1, 1]) or
input_ids (INT32 [1, n], the prompt as token ids) and, optional, max_tokens, stream, stop_words ([1, n]), temperature, top_k, top_p, seed,
frequency_penalty, presence_penalty, return_num_input_tokens, return_num_output_tokens,
exclude_input_in_output, return_log_probs, top_logprobs, return_prompt_log_probs, ignore_eos
([1, 1] each). Outputs text_output, output_ids, finish_reason ("stop" | "length", on the last
response), num_input_tokens / num_output_tokens, output_log_probs, top_log_probs_ids /
top_log_probs and prompt_ids / prompt_log_probs (each when asked; with top_logprobs > 0 also
prompt_top_log_probs_ids / prompt_top_log_probs, the prompt tokens' alternatives). Defaults are runtime.generate's:
greedy, seed 0, stop at the model's stop tokens (generate/1/generation.json: a chat model's end of
turn; else <|endoftext|> when the tokenizer has it), max_tokens from the config's
parameters (32). An input or request parameter the model does not take is refused by name
(INVALID_ARG: HTTP 400), never ignored.

    stream false (default)  one response: the whole text and every new token (a stop token
                            included), as runtime.generate returns them
    stream true             one response per new token: the text it adds (possibly "" while a
                            UTF-8 character is incomplete, for a stop token, or while the text
                            could still be the start of a stop string) and [token]; the last
                            one carries the final flag, finish_reason and the counts. The texts
                            concatenated are the non-streamed text.

Stop strings (stop_words) end the text just before the first one, matched on the decoded text
across tokens (runtime/text_stream.py, runtime.generate --stop's matcher). Logprobs are the
log-softmax of the step's raw logits (before temperature, top-k/p and penalties), computed by the
scheduler only for requests that ask.

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

from runtime.generate import GenerationConfig, check_capacity, default_stop_tokens
from runtime.sampling import SamplingConfig
from runtime.scheduler import CANCELLED, ERROR, PREFILL_CHUNK, PREFILL_TOKENS, STOP, BatchScheduler, ServerBusy
from runtime.session import RuntimeUserError
from runtime.text_stream import TextStream
from runtime.triton import llm_tensors as T

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


_KINDS = {"STRING": str, "INT32": int, "UINT64": int, "FP32": float, "BOOL": bool}   # Python type per dtype


RENAMED = {"prompt": T.TEXT_INPUT, "max_new_tokens": T.MAX_TOKENS, "stop": T.STOP_WORDS,
           "logprobs": T.TOP_LOGPROBS}     # what older clients or OpenAI's names call some inputs


def _hint(name: str) -> str:
    return f"; send it as {RENAMED[name]}" if name in RENAMED else "; the model does not take it: leave it out"


def _utf8(value, name: str) -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise RuntimeUserError(f"input {name}: expected UTF-8 text, found undecodable bytes") from None


@dataclass(frozen=True)
class Request:
    """One request's inputs (runtime/triton/llm_tensors.py), each field named after its tensor."""
    text_input: str
    max_tokens: int
    stream: bool = False
    stop_words: tuple[str, ...] = ()
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    exclude_input_in_output: bool = True
    return_log_probs: bool = False
    top_logprobs: int = 0
    return_prompt_log_probs: bool = False
    ignore_eos: bool = False
    input_ids: tuple[int, ...] = ()        # the prompt as token ids (then text_input is their decoded text)

    def check(self) -> None:
        """Refuse values the model cannot serve, naming the input (sampling values: the scheduler's submit)."""
        if not 0 <= self.top_logprobs <= T.MAX_TOP_LOGPROBS:
            raise RuntimeUserError(f"input {T.TOP_LOGPROBS}: expected 0 to {T.MAX_TOP_LOGPROBS}, found "
                                   f"{self.top_logprobs}; fix the request")
        if self.seed < 0:
            raise RuntimeUserError(f"input {T.SEED}: expected >= 0, found {self.seed}; fix the request")

    def generation_config(self, stop_tokens: tuple[int, ...]) -> GenerationConfig:
        """stop_tokens: the model's (default_stop_tokens), dropped with ignore_eos."""
        wants_logprobs = self.return_log_probs or self.top_logprobs > 0
        return GenerationConfig(max_new_tokens=self.max_tokens, seed=self.seed,
                                sampling=SamplingConfig(self.temperature, self.top_k, self.top_p,
                                                        self.frequency_penalty, self.presence_penalty),
                                stop_tokens=() if self.ignore_eos else tuple(stop_tokens),
                                logprobs=self.top_logprobs if wants_logprobs else None,
                                prompt_logprobs=self.return_prompt_log_probs)


def _text(value: str) -> np.ndarray:
    return np.array([[value.encode("utf-8")]], dtype=np.object_)                            # [1, 1]


class ResponseStream:
    """What one request's client receives, from the scheduler's events (see the module docstring).

    send(outputs, error, final): outputs a dict tensor name -> numpy array (llm_tensors.OUTPUTS) or
    None, error an exception or None; final True on the last response. Triton's response sender sits
    behind it. `stop_when` is the scheduler's hook: it is given each new token before the scheduler
    decides whether the sequence ends, and says whether a stop string completed."""

    def __init__(self, send: Callable, tokenizer, request: Request, stop: tuple[int, ...]):
        self.send, self.request = send, request
        self.text = TextStream(tokenizer, stop, request.stop_words)
        # whole responses without stop strings decode once, at the end
        self.incremental = request.stream or bool(request.stop_words)
        self._piece = ""
        self._first = True

    def stop_when(self, token: int) -> bool:
        self._piece += self.text.push(token)
        return self.text.stopped

    def on_event(self, seq, token: int | None) -> None:
        last = seq.finish is not None
        if token is None:                          # ended without a token: cancelled, error, shutdown
            if seq.finish == ERROR:
                self.send(None, RuntimeError(seq.error), True)
            elif seq.finish == CANCELLED:
                self.send(None, None, True)         # nobody may be listening; close the request
            return
        r = self.request
        if r.stream:
            piece, self._piece = self._piece, ""
            if last:
                piece += self.text.flush()
            outputs = self._outputs(seq, piece, [token], len(seq.tokens) - 1)
        elif last:
            if not self.incremental:
                for t in seq.tokens:
                    self.text.push(t)
            self.text.flush()
            outputs = self._outputs(seq, self.text.text(), list(seq.tokens), 0)
        else:
            return
        if last:
            outputs[T.FINISH_REASON] = _text(T.FINISH_STOP if seq.finish == STOP else T.FINISH_LENGTH)
            if r.return_num_input_tokens:
                outputs[T.NUM_INPUT_TOKENS] = np.array([[len(seq.prompt)]], np.int32)
            if r.return_num_output_tokens:
                outputs[T.NUM_OUTPUT_TOKENS] = np.array([[len(seq.tokens)]], np.int32)
        self.send(outputs, None, last)

    def _outputs(self, seq, text: str, tokens: list[int], first: int) -> dict:
        """text_output, output_ids and the logprobs of tokens (seq.tokens[first:]); on the first response
        the prompt (text when exclude_input_in_output is false, its logprobs when asked)."""
        r = self.request
        if self._first and not r.exclude_input_in_output:
            text = r.text_input + text
        outputs = {T.TEXT_OUTPUT: _text(text), T.OUTPUT_IDS: np.array(tokens, np.int64)}
        if seq.logprobs is not None:
            rows = seq.logprobs[first:first + len(tokens)]
            if r.return_log_probs:
                outputs[T.OUTPUT_LOG_PROBS] = np.array([lp for lp, _, _ in rows], np.float32)
            if r.top_logprobs > 0:
                outputs[T.TOP_LOG_PROBS_IDS] = np.array([ids for _, ids, _ in rows], np.int64).reshape(len(rows), -1)
                outputs[T.TOP_LOG_PROBS] = np.array([lps for _, _, lps in rows], np.float32).reshape(len(rows), -1)
        if self._first and r.return_prompt_log_probs:
            outputs[T.PROMPT_IDS] = np.array(seq.prompt, np.int64)
            outputs[T.PROMPT_LOG_PROBS] = np.array(seq.prompt_logprobs, np.float32)
            if r.top_logprobs > 0 and seq.prompt_top_logprobs is not None:
                ids, lps = seq.prompt_top_logprobs
                outputs[T.PROMPT_TOP_LOG_PROBS_IDS] = np.array(ids, np.int64).reshape(len(ids), r.top_logprobs)
                outputs[T.PROMPT_TOP_LOG_PROBS] = np.array(lps, np.float32).reshape(len(lps), r.top_logprobs)
        self._first = False
        return outputs


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
        # the model's stop tokens (generation.json beside the tokenizer, else <|endoftext|>); ignore_eos drops them
        self.stop_tokens = default_stop_tokens(self.tokenizer, False, model_dir, self.session.spec.vocab_size)
        self.scheduler = BatchScheduler(self.session, slots=int(params.get("slots", DEFAULT_SLOTS)),
                                        max_queued=int(params.get("max_queued", DEFAULT_MAX_QUEUED)),
                                        prefill_tokens=int(params.get("prefill_tokens", PREFILL_TOKENS)),
                                        prefill_chunk=int(params.get("prefill_chunk", PREFILL_CHUNK))).start()
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

    def _request(self, request) -> Request:
        """The request's inputs as a Request; an input or parameter the model does not take is refused by name."""
        given = {t.name(): t.as_numpy() for t in request.inputs()}
        for name in given:
            if name not in T.INPUT_NAMES:
                raise RuntimeUserError(f"input {name}: expected one of the generate model's inputs "
                                       f"({', '.join(T.INPUT_NAMES)}), found {name!r}{_hint(name)}")
        for name in json.loads(request.parameters() or "{}"):
            # the generate extension turns a JSON key that names no input into a request parameter
            raise RuntimeUserError(f"parameter {name}: expected one of the generate model's inputs "
                                   f"({', '.join(T.INPUT_NAMES[1:])}), found {name!r}{_hint(name)}")
        if (T.TEXT_INPUT in given) == (T.INPUT_IDS in given):
            raise RuntimeUserError(f"input {T.TEXT_INPUT}: expected the prompt as {T.TEXT_INPUT} (BYTES [1, 1]) or "
                                   f"{T.INPUT_IDS} (INT32 [1, n]), found {'both' if T.TEXT_INPUT in given else 'neither'}; "
                                   "send one")
        values: dict = {}
        dtypes = {name: dt for name, dt, _, _ in T.INPUTS}
        for f in fields(Request):
            if f.name not in given:
                continue
            a = given[f.name].reshape(-1)
            if f.name == T.STOP_WORDS:
                values[f.name] = tuple(_utf8(v, f.name) for v in a)
                continue
            if f.name == T.INPUT_IDS:
                values[f.name] = self._token_ids(a)
                values[T.TEXT_INPUT] = self.tokenizer.decode(list(values[f.name]), skip_special_tokens=False)
                continue
            if a.size != 1:
                raise RuntimeUserError(f"input {f.name}: expected one value (shape [1, 1]), found shape "
                                       f"{list(given[f.name].shape)}")
            kind = _KINDS[dtypes[f.name]]
            values[f.name] = _utf8(a[0], f.name) if kind is str else kind(a[0])
        values.setdefault(T.MAX_TOKENS, self.default_max_new_tokens)
        req = Request(**values)
        req.check()
        return req

    def _token_ids(self, a: np.ndarray) -> tuple[int, ...]:
        """input_ids: at least one id, each within the model's vocabulary (the logits it indexes)."""
        vocab = self.session.spec.vocab_size
        if a.size == 0:
            raise RuntimeUserError(f"input {T.INPUT_IDS}: expected at least one token id, found none; send the prompt")
        bad = [int(t) for t in a if not 0 <= int(t) < vocab]
        if bad:
            raise RuntimeUserError(f"input {T.INPUT_IDS}: expected token ids in [0, {vocab}), found {bad[0]}; "
                                   "encode the prompt with the model's tokenizer")
        return tuple(int(t) for t in a)

    def _sender(self, request) -> Callable:
        pb = self.pb
        sender = request.get_response_sender()

        def send(outputs, error, final):
            flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
            if error is not None:
                sender.send(pb.InferenceResponse(error=self._error(error)), flags=flags)
            elif outputs is None:
                sender.send(flags=flags)
            else:
                sender.send(pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in outputs.items()]),
                            flags=flags)
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
                config = req.generation_config(self.stop_tokens)
                prompt = list(req.input_ids) if req.input_ids else self.tokenizer.encode(req.text_input).ids
                # the scheduler checks again, in runtime.generate's words; a client sent max_tokens
                check_capacity(self.session.spec.capacity, [len(prompt)], req.max_tokens, f"input {T.MAX_TOKENS}")
                stream = ResponseStream(send, self.tokenizer, req, config.stop_tokens)
                self.scheduler.submit(prompt, config, listener=stream.on_event, cancelled_by=request.is_cancelled,
                                      stop_when=stream.stop_when if stream.incremental else None)
            except Exception as e:  # one bad request must not take the model down
                send(None, e, True)
        return None

    def finalize(self) -> None:
        self._stop_metrics.set()
        self.scheduler.close()
        self.session.deactivate()
