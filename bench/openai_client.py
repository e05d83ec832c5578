"""bench.serve's OpenAI-compatible path: one streamed request timed from its SSE chunks, and the
closed loop of clients that bench.serve's levels run.

Any server with OpenAI's routes is read by this one client, so ours (runtime.triton serve
--openai-port) and a peer's (llama.cpp's server, vLLM) are measured the same way:

    POST /v1/completions        {"prompt", "max_tokens", "temperature": 0, "stream": true,
    (or /v1/chat/completions     "stream_options": {"include_usage": true}, + the force-length fields}
     with "messages")

Per request: `sent` (just before the request is written), the arrival time of every chunk that carries
text (`choices[0].text`, or `choices[0].delta.content` for chat), the final `finish_reason`, and `usage`
(the chunk with `choices: []` that `stream_options.include_usage` asks for).

How output tokens are counted, in this order:

    usage       usage.completion_tokens, where the server sends it (ours, vLLM, llama.cpp's own
                llama-server);
    length      max_tokens, where there is no usage but the stream ended with finish_reason "length"
                (OpenAI's meaning: the request stopped at exactly max_tokens). llama-cpp-python's
                server (`python -m llama_cpp.server`, 0.3.x) takes no stream_options and streams no
                usage, so its tokens are counted this way;
    chunks      else the chunks that carried text (a lower bound: a server may send several tokens in
                one chunk, llama-cpp-python holds back a token that ends inside a UTF-8 character).

A request's tokens arrive at its chunks' times; tokens beyond its text chunks (several tokens in one
chunk) are counted at its last text chunk, i.e. as zero inter-token gaps — the same as bench.serve's
Triton path does with a piece that carries several tokens, and where they are placed does not change
the set of gaps.

Errors are counted, never hidden: an HTTP status other than 200 (`HTTP 503: <the server's message>`), an
`error` object in the stream, a stream that ends without a finish_reason (llama-cpp-python's default
`interrupt_requests` ends a streaming request that way when another one arrives), a connection failure,
and a request that finished with fewer or more tokens than max_tokens (`finished early`: the server did
not honour the force-length field, so the servers would not be compared on equal work). The tokens such a
request did stream still count in tok/s, as in the Triton path.

Forcing the length: a greedy model may reach its end-of-sequence token before max_tokens. Servers spell
"do not stop there" differently: `ignore_eos: true` (ours, vLLM, llama.cpp's llama-server) or
`min_tokens: N` (llama-cpp-python's server, which ignores `ignore_eos` silently; vLLM takes it too).
--force-length picks which fields are sent; a server that refuses an unknown field says so in every
request's error.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field

from core.errors import UsageError

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
FORCE_LENGTH = ("ignore_eos", "min_tokens", "both", "none")
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def split_url(url: str) -> tuple[str, int, str]:
    """(host, port, path prefix) of `http://HOST:PORT[/PREFIX]` or `HOST:PORT`, on this machine only;
    a trailing /v1 is dropped (the routes add it), so both spellings clients use are taken."""
    rest = url[len("http://"):] if url.startswith("http://") else url
    hostport, slash, prefix = rest.partition("/")
    host, sep, port = hostport.rpartition(":")
    if url.startswith("https://") or not sep or not port.isdigit() or not 1 <= int(port) <= 65535 or not host:
        raise UsageError(f"--url {url!r}: expected http://HOST:PORT of an OpenAI-compatible server "
                         "(e.g. http://127.0.0.1:8080), found something else; pass the server's address")
    if host not in LOOPBACK:
        raise UsageError(f"--url {url!r}: expected a server on this machine ({', '.join(LOOPBACK[:3])}), found host "
                         f"{host!r}; bench.serve loads loopback servers only")
    prefix = ("/" + prefix).rstrip("/") if slash else ""
    return host.strip("[]"), int(port), prefix.removesuffix("/v1")


def force_length_fields(mode: str, max_tokens: int) -> dict:
    """The request fields that ask a server to generate exactly max_tokens (module docstring)."""
    if mode not in FORCE_LENGTH:
        raise UsageError(f"--force-length {mode!r}: expected one of {', '.join(FORCE_LENGTH)}, found something else")
    out: dict = {}
    if mode in ("ignore_eos", "both"):
        out["ignore_eos"] = True
    if mode in ("min_tokens", "both"):
        out["min_tokens"] = max_tokens
    return out


@dataclass
class StreamResult:
    """One streamed request as the client saw it (times are time.perf_counter())."""
    sent: float
    chunk_times: list[float] = field(default_factory=list)     # chunks that carried text
    text: str = ""
    finish_reason: str | None = None
    usage_tokens: int | None = None
    error: str | None = None
    last_event: float | None = None                            # any chunk, text or not

    def tokens(self, max_tokens: int) -> tuple[int, str]:
        """(output tokens, how they were counted): module docstring."""
        if self.usage_tokens is not None:
            return self.usage_tokens, "usage"
        if self.finish_reason == "length":
            return max_tokens, "length"
        return len(self.chunk_times), "chunks"

    def arrivals(self, max_tokens: int) -> list[float]:
        """One time per output token: a chunk's time for each of its tokens, surplus at the last one."""
        n, _ = self.tokens(max_tokens)
        times = self.chunk_times or ([self.last_event] if self.last_event is not None else [])
        if not times:
            return []
        return times[:n] + [times[-1]] * max(0, n - len(times))

    def record(self, client: int, max_tokens: int) -> dict:
        """bench.serve's per-request record ({"client", "sent", "arrivals", "error"}) plus how the
        tokens were counted; a request that did not end at max_tokens is an error (docstring)."""
        n, counted = self.tokens(max_tokens)
        error = self.error
        if error is None and self.finish_reason is None:
            error = f"stream ended without a finish_reason after {len(self.chunk_times)} text chunk(s)"
        elif error is None and n < max_tokens:
            error = (f"finished early: finish_reason {self.finish_reason!r} after {n} of {max_tokens} tokens "
                     f"(counted by {counted}); the server did not honour --force-length")
        elif error is None and n > max_tokens:
            error = f"ran over: {n} tokens (counted by {counted}) for max_tokens {max_tokens}"
        return {"client": client, "sent": self.sent, "arrivals": self.arrivals(max_tokens), "error": error,
                "chunks": len(self.chunk_times), "counted_by": counted}


class OpenAIClient:
    """Streamed requests to one OpenAI-compatible server over one kept-alive HTTP/1.1 connection
    (a closed-loop client sends one request at a time), with the standard library only."""

    def __init__(self, url: str, model: str | None = None, endpoint: str = "completions",
                 force_length: str = "ignore_eos", timeout_s: float = 600.0):
        self.host, self.port, self.prefix = split_url(url)
        if endpoint not in ENDPOINTS:
            raise UsageError(f"--endpoint {endpoint!r}: expected one of {', '.join(ENDPOINTS)}, found something else")
        force_length_fields(force_length, 1)        # refused here, before any load
        self.model, self.endpoint, self.force_length, self.timeout_s = model, endpoint, force_length, timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def __enter__(self) -> "OpenAIClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def body(self, prompt: str, max_tokens: int) -> dict:
        body: dict = {"max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                      "stream_options": {"include_usage": True}, **force_length_fields(self.force_length, max_tokens)}
        if self.model is not None:
            body["model"] = self.model
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    def stream(self, prompt: str, max_tokens: int) -> StreamResult:
        """Send one streamed request and time its chunks; never raises for the server's or the network's
        failures (they are the result's `error`, first line only). A kept-alive connection that the server
        closed meanwhile (its idle timeout) fails before any answer: the request is sent once more on a new
        connection, as HTTP clients do, and timed from that send."""
        payload = json.dumps(self.body(prompt, max_tokens)).encode()
        for attempt in (1, 2):
            reused = self._conn is not None
            result = StreamResult(sent=time.perf_counter())
            try:
                if self._conn is None:
                    self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
                self._conn.request("POST", self.prefix + ENDPOINTS[self.endpoint], body=payload,
                                   headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
                resp = self._conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                self.close()
                if reused and attempt == 1:
                    continue
                result.error = _exception_line(e)
                return result
            except (OSError, http.client.HTTPException) as e:
                self.close()
                result.error = _exception_line(e)
                return result
            try:
                if resp.status != 200:
                    result.error = f"HTTP {resp.status}: {_error_message(resp.read())}"
                else:
                    self._read_events(resp, result)
                if resp.will_close or result.error:
                    self.close()                # a fresh connection for the next request
            except (OSError, http.client.HTTPException) as e:
                self.close()
                result.error = _exception_line(e)
            return result
        raise AssertionError("unreachable")

    def _read_events(self, resp: http.client.HTTPResponse, result: StreamResult) -> None:
        """Server-sent events: `data: <json>` lines until `data: [DONE]` or the end of the body."""
        while True:
            line = resp.readline()
            if not line:
                return              # the body ended without [DONE]: record() tells whether it finished
            line = line.strip()
            if not line.startswith(b"data:"):
                continue            # blank separators, `: ping` comments, `event:` lines
            data = line[5:].strip()
            now = time.perf_counter()
            if data == b"[DONE]":
                resp.read()         # drain, so the connection can carry the next request
                return
            try:
                event = json.loads(data)
            except ValueError:
                result.error = f"not JSON in the stream: {data[:80]!r}"
                return
            result.last_event = now
            if not isinstance(event, dict):
                result.error = f"not a JSON object in the stream: {data[:80]!r}"
                return
            if event.get("error") is not None:
                result.error = "server: " + _error_message(json.dumps(event).encode())
                return
            usage = event.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                result.usage_tokens = usage["completion_tokens"]
            for choice in event.get("choices") or []:
                text = choice.get("text") if self.endpoint == "completions" else (choice.get("delta") or {}).get("content")
                if text:
                    result.chunk_times.append(now)
                    result.text += text
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]


def served_model(url: str, timeout_s: float = 30.0) -> str | None:
    """The first model id of GET /v1/models, the name requests then carry (OpenAI's `model` is required,
    and ours refuses a request without it); None where the route does not answer with one."""
    host, port, prefix = split_url(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", prefix + "/v1/models")
        resp = conn.getresponse()
        data = json.loads(resp.read()) if resp.status == 200 else {}
        models = data.get("data") if isinstance(data, dict) else None
        first = models[0] if isinstance(models, list) and models else None
        return first.get("id") if isinstance(first, dict) and isinstance(first.get("id"), str) else None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


def _exception_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'connection failed'}"


def _error_message(raw: bytes) -> str:
    """The first line of an OpenAI error object's message, or of the body as text."""
    text = raw.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message") or err.get("detail") if isinstance(err, dict) else err
        text = msg if isinstance(msg, str) else json.dumps(msg)
    except ValueError:
        pass
    return (text.strip().splitlines() or ["(empty body)"])[0][:300]


# --- the closed loop ---------------------------------------------------------------------------------

def closed_loop(concurrency: int, requests: int, open_client, one_request) -> dict:
    """`concurrency` clients (threads), each sending its next request as soon as its previous one has
    finished, until `requests` are done: {"start", "end", "records"} as bench.serve's levels keep them.
    open_client() makes one client's connection (a context manager); one_request(client, i, k) sends
    request i from client k and returns its record (with "arrivals")."""
    lock = threading.Lock()
    issued = [0]
    records: list[dict] = []

    def client_loop(k: int) -> None:
        with open_client() as client:
            while True:
                with lock:
                    if issued[0] >= requests:
                        return
                    i = issued[0]
                    issued[0] += 1
                rec = one_request(client, i, k)
                with lock:
                    records.append(rec)

    threads = [threading.Thread(target=client_loop, args=(k,), daemon=True) for k in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = max([r["arrivals"][-1] for r in records if r["arrivals"]] + [start])
    return {"start": start, "end": end, "records": records}


def run_level(url: str, concurrency: int, requests: int, prompts: list[str], max_tokens: int, *,
              model: str | None = None, endpoint: str = "completions", force_length: str = "ignore_eos",
              timeout_s: float = 600.0) -> dict:
    """One bench.serve level against an OpenAI-compatible server: raw per-request timings."""
    def one(client: OpenAIClient, i: int, k: int) -> dict:
        return client.stream(prompts[i % len(prompts)], max_tokens).record(k, max_tokens)
    return closed_loop(concurrency, requests,
                       lambda: OpenAIClient(url, model, endpoint, force_length, timeout_s), one)


def warm_up(url: str, prompts: list[str], max_tokens: int, n: int, *, model: str | None = None,
            endpoint: str = "completions", force_length: str = "ignore_eos", timeout_s: float = 600.0) -> None:
    """Untimed requests first; the first one's failure is refused before any load (an unreachable
    server, a wrong route or model, a refused field), as the Triton path's first request is."""
    from core.errors import UserError
    with OpenAIClient(url, model, endpoint, force_length, timeout_s) as client:
        for i in range(max(1, n)):
            rec = client.stream(prompts[i % len(prompts)], max_tokens).record(0, max_tokens)
            if rec["error"] and i == 0:
                raise UserError(f"--url {url}: expected a streamed {ENDPOINTS[endpoint]} answer of {max_tokens} "
                                f"tokens, found {rec['error']}; start the server, or fix --endpoint / --model / "
                                "--force-length")

