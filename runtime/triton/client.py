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
from core.errors import first_line
from runtime.session import MissingExtraError, RuntimeUserError

PROTOCOLS = ("http", "grpc")
SAMPLING_INPUTS = (("max_new_tokens", "INT32", np.int32), ("temperature", "FP32", np.float32),
                   ("top_k", "INT32", np.int32), ("top_p", "FP32", np.float32), ("seed", "INT64", np.int64),
                   ("ignore_eos", "BOOL", np.bool_), ("stream", "BOOL", np.bool_))


class ClientError(RuntimeUserError):
    """The server refused the request or could not be reached; the message is the server's."""


def _module(protocol: str):
    if protocol not in PROTOCOLS:
        raise ClientError(f"--protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    try:
        return importlib.import_module(f"tritonclient.{protocol}")
    except ImportError:
        raise MissingExtraError("runtime.triton client", "triton", f"tritonclient.{protocol}") from None


def build_inputs(m, prompt: str, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 ignore_eos: bool | None = None, stream: bool | None = None):
    """InferInputs of module m (tritonclient.grpc or .http); options left None are not sent."""
    given = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
             "seed": seed, "ignore_eos": ignore_eos, "stream": stream}
    values = [("prompt", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES")]
    values += [(name, np.array([given[name]], dtype=np_dt), dt) for name, dt, np_dt in SAMPLING_INPUTS
               if given[name] is not None]
    return [m.InferInput(name, list(array.shape), dt).set_data_from_numpy(array) for name, array, dt in values]


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
                    model: str = "generate", timeout_s: float = 120.0, on_text=None,
                    **sampling) -> tuple[str, list[int]]:
    """(text, new tokens) from the server's generate model; raises ClientError with the server's message.

    on_text: called with each piece of text as its token arrives (streamed); the pieces
    concatenated are the returned text."""
    _module(protocol)
    check_url(url)
    if protocol == "http":
        return _generate_http(url, prompt, max_new_tokens, model, timeout_s, on_text, **sampling)
    with StreamingClient(url, model=model, timeout_s=timeout_s) as client:
        on_piece = None if on_text is None else (lambda text, tokens: on_text(text))
        return client.generate(prompt, max_new_tokens, on_piece=on_piece, **sampling)


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

    def generate(self, prompt: str, max_new_tokens: int | None = None, on_piece=None,
                 **sampling) -> tuple[str, list[int]]:
        """(text, new tokens); see the class docstring."""
        from tritonclient.utils import InferenceServerException
        self._n += 1
        finished = False
        try:
            responses = self._start()
            inputs = build_inputs(self.m, prompt, max_new_tokens, stream=True if on_piece else None, **sampling)
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
            texts, tokens = [], []
            while True:
                try:
                    result, error = responses.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise ClientError(f"triton {self.url} model {self.model!r}: expected the answer within "
                                      f"{self.timeout_s:g} s, found none; raise --timeout") from None
                if error is not None:
                    raise error
                response = result.get_response()
                text = result.as_numpy("text")
                if text is not None:
                    piece = text.reshape(-1)[0]
                    piece = piece.decode("utf-8") if isinstance(piece, bytes) else str(piece)
                    new = [int(t) for t in result.as_numpy("tokens").reshape(-1)]
                    texts.append(piece)
                    tokens += new
                    if on_piece is not None:
                        on_piece(piece, new)
                if response.parameters["triton_final_response"].bool_param:
                    finished = True
                    return "".join(texts), tokens
        except InferenceServerException as e:
            finished = "StatusCode" not in str(e.status())     # a request error: the stream itself is fine
            if e.status() == "StatusCode.UNAVAILABLE" and "server busy" not in str(e):
                raise ClientError(f"triton {self.url}: expected a server there, found none ({_one_line(e)}); "
                                  "start one with python -m runtime.triton serve --repo REPO") from None
            raise ClientError(f"triton {self.url} model {self.model!r}: {_one_line(e)}") from None
        finally:
            if not finished:
                self._stop(cancel=True)      # frees the request's slot on the server


def _generate_http(url: str, prompt: str, max_new_tokens, model: str, timeout_s: float, on_text,
                   **sampling) -> tuple[str, list[int]]:
    """Triton's generate extension: JSON in, one JSON answer (or server-sent events with on_text) out."""
    body = {"prompt": prompt, **{k: v for k, v in (("max_new_tokens", max_new_tokens), *sampling.items())
                                 if v is not None}}
    if on_text is not None:
        body["stream"] = True
    endpoint = "generate_stream" if on_text is not None else "generate"
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/{endpoint}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    texts, tokens = [], []

    def take(answer: dict) -> None:
        if "error" in answer:
            raise ClientError(f"triton {url} model {model!r}: {' '.join(str(answer['error']).split())}")
        piece = answer.get("text", "")
        texts.append(piece)
        new = answer.get("tokens", [])
        tokens.extend(int(t) for t in (new if isinstance(new, list) else [new]))
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
            answer = json.loads(body[5:] if body.startswith("data:") else body)
        except ValueError:
            answer = {}
        take(answer if isinstance(answer, dict) and "error" in answer else {"error": f"HTTP {e.code} {e.reason}"})
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
    return "".join(texts), tokens


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
