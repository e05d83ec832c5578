"""A tiny in-process OpenAI-compatible server for bench.serve --api openai and bench.llamacpp's tests:
SSE over chunked HTTP/1.1 on kept-alive connections. It streams one chunk per token (or `per_chunk`
tokens per chunk), sends `usage` only when stream_options.include_usage asks (and `usage` is on),
names one model on GET /v1/models (or has no such route), may close kept-alive connections without a
word (`hang_up`, as a server's idle timeout does), and misbehaves on cue (the prompt names
the cue) as real servers do: `busy` a 503 with an OpenAI error object, `error` an error event, `cut`
a stream ended without a finish_reason, `early` an end-of-sequence after 3 tokens unless ignore_eos
or min_tokens asks for more."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class FakeOpenAI(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    usage = True            # honour stream_options.include_usage
    per_chunk = 1           # tokens per text chunk
    model_id = "generate"   # what GET /v1/models names (None: no such route)
    hang_up = False         # close each kept-alive connection after its response, without saying so
    bodies: list = []

    def log_message(self, *a):      # quiet
        pass

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, obj) -> None:
        self._chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

    def do_GET(self):
        if self.path != "/v1/models" or self.model_id is None:
            return self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
        self._json(200, {"object": "list", "data": [{"id": self.model_id, "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append({"path": self.path, **body})
        chat = self.path == "/v1/chat/completions"
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
        if "busy" in prompt:
            return self._json(503, {"error": {"message": "server busy: 4 running, 0 queued", "type": "overloaded"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = body["max_tokens"]
        if "early" in prompt and not body.get("ignore_eos") and body.get("min_tokens", 0) < n:
            n = 3                   # the model met its end-of-sequence token
        if "error" in prompt:
            self._event({"error": {"message": "model crashed\nsecond line", "type": "server_error"}})
            self._event(b"[DONE]")
            return self._chunk(b"")
        self._chunk(b": ping\n\n")
        if chat:
            self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        sent = 0
        while sent < n:
            k = min(self.per_chunk, n - sent)
            piece = "".join(f" t{sent + j}" for j in range(k))
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            self._event({"choices": [{**choice, "finish_reason": None}]})
            sent += k
            if "cut" in prompt and sent >= 2:
                self._event(b"[DONE]")
                return self._chunk(b"")
        reason = "length" if n == body["max_tokens"] else "stop"
        self._event({"choices": [{"index": 0, "finish_reason": reason, **({"delta": {}} if chat else {"text": ""})}]})
        if self.usage and (body.get("stream_options") or {}).get("include_usage"):
            self._event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}})
        self._event(b"[DONE]")
        self._chunk(b"")
        if self.hang_up:
            self.close_connection = True

    def _json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def start_fake(**attrs):
    """(server, url, handler class) of a fake on a free port; attrs override the class's settings."""
    handler = type("Handler", (FakeOpenAI,), {"bodies": [], **attrs})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", handler


def stop_fake(server) -> None:
    server.shutdown()
    server.server_close()


@pytest.fixture
def fake():
    """fake(**attrs) -> (url, handler class); every fake started is stopped after the test."""
    servers: list = []

    def start(**attrs):
        server, url, handler = start_fake(**attrs)
        servers.append(server)
        return url, handler
    yield start
    for s in servers:
        stop_fake(s)
