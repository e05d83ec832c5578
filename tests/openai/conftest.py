"""Fixtures for the OpenAI API tests: the app served by uvicorn on 127.0.0.1 over a scripted engine
(FakeEngine: no Triton; routes, validation, errors, SSE shape, disconnects) — the tests against a real
Triton server are in test_serving.py."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest



def require_api() -> None:
    for module in ("pydantic", "starlette", "uvicorn", "jinja2", "openai"):
        pytest.importorskip(module, reason=f"the OpenAI API tests need {module} (pip install -e '.[dev,triton]')")


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


class FakeEngine:
    """generate(): the prompt's words back, one piece per word (ids = word lengths), finish "length" after
    max_tokens words or "stop"; prompts starting with BUSY / BAD / SLOW: a 503, a model 400, pieces every 0.2 s
    (forever) so a disconnect can cancel them. Records the requests it saw and the ones cancelled."""

    def __init__(self):
        self.seen, self.cancelled = [], []
        self.lock = threading.Lock()

    async def open(self):
        pass

    async def close(self):
        pass

    async def ready(self):
        return True

    async def generate(self, req):
        from runtime.openai.engine import Piece
        from runtime.openai.protocol import OpenAIError
        with self.lock:
            self.seen.append(req)
        if req.prompt.startswith("BUSY"):
            raise OpenAIError(503, "server busy: 8 sequences running and 32 waiting; retry later", "server_error")
        if req.prompt.startswith("BAD"):
            raise OpenAIError(400, "input max_tokens: expected at most 480 (the capacity), found 10000")
        words = req.prompt.split()
        n = req.max_tokens or 16
        try:
            i = 0
            while True:
                if req.prompt.startswith("SLOW"):
                    await asyncio.sleep(0.2)
                word = words[i % len(words)] if words else "x"
                last = i + 1 >= n and not req.prompt.startswith("SLOW")
                piece = Piece(text=(" " if i else "") + word, ids=[len(word)])
                if req.logprobs:
                    piece.logprobs = [-0.5]
                    if req.top_logprobs:
                        piece.top_ids = [[len(word), 99][:req.top_logprobs]]
                        piece.top_logprobs = [[-0.5, -1.5][:req.top_logprobs]]
                if req.prompt_logprobs and i == 0:
                    piece.prompt_ids = [len(w) for w in words]
                    piece.prompt_logprobs = [None] + [-2.0] * (len(words) - 1)
                if last:
                    piece.finish_reason = "length"
                    piece.num_input_tokens, piece.num_output_tokens = len(words), n
                yield piece
                if last:
                    return
                if req.prompt.startswith("FAILMID"):
                    raise OpenAIError(500, "internal error: RuntimeError: the backend failed", "server_error")
                i += 1
        except (asyncio.CancelledError, GeneratorExit):
            with self.lock:
                self.cancelled.append(req.prompt)
            raise


@pytest.fixture(scope="module")
def fake_api():
    """(base url, FakeEngine) of the app on a free port, with a chat template."""
    require_api()
    import uvicorn
    from runtime.openai.app import create_app
    from runtime.triton.server import free_port
    engine = FakeEngine()
    template = {"chat_template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                                 "{% if add_generation_prompt %}assistant:{% endif %}"}
    app = create_app(engine, "generate", FakeTokenizer(), template)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(10)


from tests.triton.conftest import triton_build  # noqa: E402,F401 - the build fixture the serving tests use
