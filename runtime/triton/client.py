"""Client of the repository's `generate` model over HTTP or gRPC (tritonclient), whole or streamed.

    text, tokens = generate_remote("127.0.0.1:8000", "Once upon a time", max_new_tokens=64)
    text, tokens = generate_remote("127.0.0.1:8001", "Once upon a time", protocol="grpc",
                                   on_text=lambda piece: print(piece, end="", flush=True))

The generate model is decoupled (its responses come from the server's batch scheduler),
and Triton serves decoupled models over gRPC streaming and HTTP's generate extension only
(its unary ModelInfer and /infer refuse them). So:

    grpc  one stream per client (StreamingClient): one response with the whole text, or with
          on_text one response per token; a request that is given up (timeout, Ctrl-C, an
          error in on_text) is cancelled on the server, which frees its slot
    http  POST /v2/models/<model>/generate (one JSON answer), or with on_text
          /generate_stream (server-sent events, one per token)

Close the client when done (these functions do): a server being stopped waits for open
connections up to its exit timeout.
"""
from __future__ import annotations

import contextlib
import http.client
import importlib
import json
import queue
import time
import urllib.error
import urllib.request

import numpy as np

from core.contract import INPUT_IDS, LOGITS, POSITION
from runtime.triton import llm_tensors as T
from core.errors import first_line
from runtime.session import MissingExtraError, RuntimeUserError

PROTOCOLS = ("http", "grpc")
# the client's keyword -> the generate model's input (runtime/triton/llm_tensors.py) and its numpy type
SAMPLING_INPUTS = (("max_new_tokens", T.MAX_TOKENS, np.int32), ("temperature", T.TEMPERATURE, np.float32),
                   ("top_k", T.TOP_K, np.int32), ("top_p", T.TOP_P, np.float32), ("seed", T.SEED, np.uint64),
                   ("frequency_penalty", T.FREQUENCY_PENALTY, np.float32),
                   ("presence_penalty", T.PRESENCE_PENALTY, np.float32),
                   ("ignore_eos", T.IGNORE_EOS, np.bool_), ("stream", T.STREAM, np.bool_))


class ClientError(RuntimeUserError):
    """The server refused the request or could not be reached; the message is the server's."""


def _module(protocol: str):
    if protocol not in PROTOCOLS:
        raise ClientError(f"--protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    try:
        return importlib.import_module(f"tritonclient.{protocol}")
    except ImportError:
        raise MissingExtraError("runtime.triton client", "triton", f"tritonclient.{protocol}") from None


def request_values(prompt: str, max_new_tokens: int | None = None, stop: list[str] | None = None,
                   logprobs: int | None = None, details: bool = False, **sampling) -> dict:
    """The generate model's inputs for one request, name -> value (a list for stop_words); options left
    None are not sent. logprobs k: the chosen tokens' logprobs and the k most likely (0: the chosen only);
    details: the token counts too."""
    unknown = set(sampling) - {key for key, _, _ in SAMPLING_INPUTS}
    if unknown:
        raise TypeError(f"request_values: unexpected keyword {sorted(unknown)[0]!r}")
    given = {"max_new_tokens": max_new_tokens, **sampling}
    values: dict = {T.TEXT_INPUT: prompt}
    values.update((name, np_dt(given[key]).item()) for key, name, np_dt in SAMPLING_INPUTS
                  if given.get(key) is not None)
    if stop:
        values[T.STOP_WORDS] = list(stop)
    if logprobs is not None:
        values[T.RETURN_LOG_PROBS] = True
        if logprobs > 0:
            values[T.TOP_LOGPROBS] = int(logprobs)
    if details:
        values[T.RETURN_NUM_INPUT_TOKENS] = values[T.RETURN_NUM_OUTPUT_TOKENS] = True
    return values


def build_inputs(m, prompt: str, max_new_tokens: int | None = None, **options):
    """InferInputs of module m (tritonclient.grpc or .http) in the shapes of the model's config: [1, 1]
    each, stop_words [1, n] (request_values says which are sent)."""
    np_types = {name: np_dt for _, name, np_dt in SAMPLING_INPUTS}
    np_types.update({T.RETURN_LOG_PROBS: np.bool_, T.TOP_LOGPROBS: np.int32, T.RETURN_NUM_INPUT_TOKENS: np.bool_,
                     T.RETURN_NUM_OUTPUT_TOKENS: np.bool_})
    inputs = []
    for name, value in request_values(prompt, max_new_tokens, **options).items():
        if name in (T.TEXT_INPUT, T.STOP_WORDS):
            words = [value] if name == T.TEXT_INPUT else value
            array = np.array([[w.encode("utf-8") for w in words]], dtype=np.object_)             # [1, n]
        else:
            array = np.array([[value]], dtype=np_types[name])                                    # [1, 1]
        inputs.append(m.InferInput(name, list(array.shape), T.CLIENT_DTYPES[name]).set_data_from_numpy(array))
    return inputs


def check_url(url: str) -> str:
    """HOST:PORT with a port in 1..65535 (what both tritonclient protocols take), or ClientError."""
    host, sep, port = url.rpartition(":")
    ok = bool(sep) and host.strip("[]") != "" and port.isdigit() and 1 <= int(port) <= 65535 \
        and all(c.isalnum() or c in ".-_[]:" for c in host)
    if not ok:
        raise ClientError(f"--url {url!r}: expected HOST:PORT of a Triton server (e.g. 127.0.0.1:8000), "
                          "found something else; pass the server's address")
    return url


def generate_remote(url: str, prompt: str, max_new_tokens: int | None = None, protocol: str = "http",
                    model: str = "generate", timeout_s: float = 120.0, on_text=None, info: dict | None = None,
                    **options) -> tuple[str, list[int]]:
    """(text, new tokens) from the server's generate model; raises ClientError with the server's message.

    on_text: called with each piece of text as its token arrives (streamed); the pieces
    concatenated are the returned text. options: temperature, top_k, top_p, seed, frequency_penalty,
    presence_penalty, ignore_eos, stop (a list of stop strings), logprobs (k), details (the counts):
    see request_values. info, a dict, receives finish_reason, and logprobs / num_input_tokens /
    num_output_tokens where asked (Answer.into)."""
    _module(protocol)
    check_url(url)
    if protocol == "http":
        return _generate_http(url, prompt, max_new_tokens, model, timeout_s, on_text, info, **options)
    with StreamingClient(url, model=model, timeout_s=timeout_s) as client:
        on_piece = None if on_text is None else (lambda text, tokens: on_text(text))
        return client.generate(prompt, max_new_tokens, on_piece=on_piece, info=info, **options)


class Answer:
    """The responses of one request, gathered: text pieces, tokens, finish_reason, logprobs, counts."""

    def __init__(self):
        self.texts: list[str] = []
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []   # (token, logprob, top (id, logprob))
        self.counts: dict[str, int] = {}

    def take(self, get) -> tuple[str, list[int]]:
        """Add one response; get(name) is its output as a numpy array or None. The piece and its tokens."""
        def one(name):
            a = get(name)
            if a is None:
                return None
            v = np.asarray(a).reshape(-1)[0]
            return v.decode("utf-8") if isinstance(v, bytes) else v
        piece = one(T.TEXT_OUTPUT)
        piece = "" if piece is None else str(piece)
        ids = get(T.OUTPUT_IDS)
        new = [] if ids is None else [int(t) for t in np.asarray(ids).reshape(-1)]
        self.texts.append(piece)
        self.tokens += new
        lps = get(T.OUTPUT_LOG_PROBS)
        if lps is not None:
            top_ids, top_lps = get(T.TOP_LOG_PROBS_IDS), get(T.TOP_LOG_PROBS)
            n = len(new)
            top_ids = np.zeros((n, 0), np.int64) if top_ids is None else np.asarray(top_ids).reshape(n, -1)
            top_lps = np.zeros((n, 0)) if top_lps is None else np.asarray(top_lps, np.float64).reshape(n, -1)
            for t, lp, ti, tl in zip(new, np.asarray(lps, np.float64).reshape(-1), top_ids, top_lps):
                self.logprobs.append((t, float(lp), [(int(a), float(b)) for a, b in zip(ti, tl)]))
        reason = one(T.FINISH_REASON)
        if reason is not None:
            self.finish_reason = str(reason)
        for name in (T.NUM_INPUT_TOKENS, T.NUM_OUTPUT_TOKENS):
            count = one(name)
            if count is not None:
                self.counts[name] = int(count)
        return piece, new

    def into(self, info: dict | None) -> tuple[str, list[int]]:
        if info is not None:
            info["finish_reason"] = self.finish_reason
            if self.logprobs:
                info["logprobs"] = self.logprobs
            info.update(self.counts)
        return "".join(self.texts), self.tokens


class StreamingClient:
    """One gRPC connection with one open stream to the generate model; one request at a time.

        with StreamingClient("127.0.0.1:8001") as c:
            text, tokens = c.generate("Once upon a time", 32, on_piece=lambda text, tokens: ...)

    on_piece(text, tokens) is called for each response as it arrives (with on_piece the model
    streams one response per token). A request that ends in an exception here (timeout,
    KeyboardInterrupt, on_piece raising, a server error) closes the stream with cancellation,
    so the server frees its slot; the next request opens a new stream.
    """

    def __init__(self, url: str, model: str = "generate", timeout_s: float = 120.0):
        m = _module("grpc")
        check_url(url)
        self.url, self.model, self.timeout_s = url, model, timeout_s
        try:
            self.client = m.InferenceServerClient(url=url)
        except Exception as e:  # bad URL syntax
            raise ClientError(f"--url {url!r}: expected HOST:PORT of a Triton server, found an error ({e})") from None
        self.m = m
        self._responses: queue.SimpleQueue | None = None
        self._n = 0

    def __enter__(self) -> "StreamingClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.client is not None:
            self._stop(cancel=True)
            self.client.close()
            self.client = None

    def _stop(self, cancel: bool) -> None:
        if self._responses is not None:
            self._responses = None
            with contextlib.suppress(Exception):    # the stream is already broken; nothing to stop
                self.client.stop_stream(cancel_requests=cancel)

    def _start(self) -> queue.SimpleQueue:
        if self._responses is None:
            responses: queue.SimpleQueue = queue.SimpleQueue()
            self.client.start_stream(callback=lambda result, error: responses.put((result, error)))
            self._responses = responses
        return self._responses

    def generate(self, prompt: str, max_new_tokens: int | None = None, on_piece=None, info: dict | None = None,
                 **options) -> tuple[str, list[int]]:
        """(text, new tokens); see the class docstring and generate_remote (options, info)."""
        from tritonclient.utils import InferenceServerException
        self._n += 1
        finished = False
        try:
            responses = self._start()
            inputs = build_inputs(self.m, prompt, max_new_tokens, stream=True if on_piece else None, **options)
            try:
                self.client.async_stream_infer(self.model, inputs, request_id=str(self._n),
                                               enable_empty_final_response=True)
            except InferenceServerException:    # the stream broke already: its callback holds the reason
                try:
                    _, error = responses.get(timeout=5)
                except queue.Empty:
                    raise ClientError(f"triton {self.url}: expected a server there, found the stream broken; "
                                      "start one with python -m runtime.triton serve --repo REPO") from None
                raise error or ClientError(f"triton {self.url}: the stream broke without a reason") from None
            deadline = time.monotonic() + self.timeout_s
            answer = Answer()
            while True:
                try:
                    result, error = responses.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise ClientError(f"triton {self.url} model {self.model!r}: expected the answer within "
                                      f"{self.timeout_s:g} s, found none; raise --timeout") from None
                if error is not None:
                    raise error
                response = result.get_response()
                if response.outputs:
                    piece, new = answer.take(result.as_numpy)
                    if on_piece is not None:
                        on_piece(piece, new)
                if response.parameters["triton_final_response"].bool_param:
                    finished = True
                    return answer.into(info)
        except InferenceServerException as e:
            finished = "StatusCode" not in str(e.status())     # a request error: the stream itself is fine
            if e.status() == "StatusCode.UNAVAILABLE" and "server busy" not in str(e):
                raise ClientError(f"triton {self.url}: expected a server there, found none ({_one_line(e)}); "
                                  "start one with python -m runtime.triton serve --repo REPO") from None
            raise ClientError(f"triton {self.url} model {self.model!r}: {_one_line(e)}") from None
        finally:
            if not finished:
                self._stop(cancel=True)      # frees the request's slot on the server


def _generate_http(url: str, prompt: str, max_new_tokens, model: str, timeout_s: float, on_text, info=None,
                   **options) -> tuple[str, list[int]]:
    """Triton's generate extension: JSON text_input + parameters in (each parameter becomes the input of
    that name), one JSON answer (or server-sent events with on_text) out."""
    values = request_values(prompt, max_new_tokens, stream=True if on_text is not None else None, **options)
    body = {T.TEXT_INPUT: values.pop(T.TEXT_INPUT), "parameters": values}
    endpoint = "generate_stream" if on_text is not None else "generate"
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/{endpoint}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    answer = Answer()

    def take(response: dict) -> None:
        if "error" in response:
            raise ClientError(f"triton {url} model {model!r}: {' '.join(str(response['error']).split())}")
        piece, _ = answer.take(response.get)
        if on_text is not None:
            on_text(piece)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            if on_text is None:
                take(json.loads(r.read().decode("utf-8")))
            else:
                for line in r:
                    if line.startswith(b"data:"):
                        take(json.loads(line[5:].decode("utf-8")))
    except urllib.error.HTTPError as e:      # the body is {"error": ...}, or one event "data: {"error": ...}"
        body = e.read().decode("utf-8", errors="replace").strip()
        try:
            refusal = json.loads(body[5:] if body.startswith("data:") else body)
        except ValueError:
            refusal = {}
        take(refusal if isinstance(refusal, dict) and "error" in refusal else {"error": f"HTTP {e.code} {e.reason}"})
    except TimeoutError:                     # the server is there, the answer is not
        raise ClientError(f"triton {url} model {model!r}: expected the answer within {timeout_s:g} s, found none; "
                          "raise --timeout") from None
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ClientError(f"triton {url}: expected a server there, found none ({first_line(reason)}); "
                          "start one with python -m runtime.triton serve --repo REPO") from None
    except (ValueError, UnicodeDecodeError, http.client.HTTPException) as e:
        raise ClientError(f"triton {url}: expected a Triton http endpoint, found an answer the http client cannot "
                          f"read ({type(e).__name__}: {first_line(e)}); check --url and --protocol "
                          "(the HTTP and gRPC ports differ)") from None
    return answer.into(info)


def _one_line(e) -> str:
    msg = e.message() if callable(getattr(e, "message", None)) else str(e)
    status = e.status() if callable(getattr(e, "status", None)) else None
    msg = " ".join(str(msg).split())
    return f"{msg} ({status})" if status else msg


def decode_with_state(client, m, prompt_ids: list[int], max_new_tokens: int, model: str = "decoder_onnx",
                      sequence_id: int = 1, stop_tokens: tuple[int, ...] = ()) -> list[int]:
    """Greedy tokens from a decoder model whose KV cache lives in the server (implicit state).

    client: an InferenceServerClient of module m (tritonclient.http or tritonclient.grpc).
    The protocol of docs/triton.md: request 1 sends the prompt at position 0 with
    sequence_start; each later request sends the previous token at position = number of
    tokens sent so far; the last request carries sequence_end (a stop token, if one ends
    the generation early, is sent as that last request so the server frees the slot).
    For a full Triton server with the onnxruntime / tensorrt backends (not the CPU one).
    """
    def infer(ids: list[int], position: int, start: bool, end: bool):
        inputs = [m.InferInput(INPUT_IDS, [1, len(ids)], "INT64"), m.InferInput(POSITION, [1, 1], "INT64")]
        inputs[0].set_data_from_numpy(np.array([ids], np.int64))                               # [1, T]
        inputs[1].set_data_from_numpy(np.array([[position]], np.int64))                        # [1, 1] -> [1]
        result = client.infer(model, inputs, outputs=[m.InferRequestedOutput(LOGITS)], sequence_id=sequence_id,
                              sequence_start=start, sequence_end=end)
        return result.as_numpy(LOGITS)                                                       # [1, T, V]

    tokens: list[int] = []
    ids, position = list(prompt_ids), 0
    for step in range(max_new_tokens):
        logits = infer(ids, position, start=step == 0, end=step == max_new_tokens - 1)
        position += len(ids)
        ids = [int(logits[0, -1].argmax())]
        tokens.append(ids[0])
        if ids[0] in stop_tokens and step < max_new_tokens - 1:
            infer(ids, position, start=False, end=True)
            break
    return tokens
