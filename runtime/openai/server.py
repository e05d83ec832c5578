"""The OpenAI API's HTTP server: uvicorn running runtime/openai/app.py in a thread of `runtime.triton
serve --openai-port PORT` (or of a test), beside the Triton server it talks to over gRPC.

    api = OpenAIServerThread(repo, grpc_url="127.0.0.1:8001", port=9000).start()   # returns when listening
    ...
    api.stop()

The model's tokenizer (for logprobs' token texts) and chat template come from the repository's
generate/1 folder (tokenizer.json, chat_template.json); chat_template overrides the template (a file
core.chat_template.load_chat_template reads). Binds 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import importlib
import logging
import socket
import threading
import time
from pathlib import Path

from runtime.session import MissingExtraError, RuntimeUserError

GENERATE = "generate"


def _require() -> None:
    for module in ("starlette", "uvicorn", "jinja2", "tritonclient.grpc.aio"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise MissingExtraError("runtime.triton serve --openai-port", "triton", module) from None


def load_model_files(repo: str | Path, chat_template: str | Path | None = None, model: str = GENERATE):
    """(tokenizer, chat template dict or None) of the repository's generate model."""
    from core.chat_template import load_chat_template, read_hf_chat_template
    from runtime.model_files import load_tokenizer
    from runtime.openai.chat_template import check_template
    folder = Path(repo) / model / "1"
    tokenizer = load_tokenizer(folder)
    template = load_chat_template(chat_template) if chat_template is not None else read_hf_chat_template(folder)
    if template is not None:
        check_template(template)
    return tokenizer, template


class OpenAIServerThread:
    def __init__(self, repo: str | Path, grpc_url: str, port: int, host: str = "127.0.0.1",
                 chat_template: str | Path | None = None, model: str = GENERATE, log_level: str = "warning"):
        _require()
        self.repo, self.grpc_url, self.host, self.port, self.model = Path(repo), grpc_url, host, port, model
        self.tokenizer, self.chat_template = load_model_files(repo, chat_template, model)
        self.log_level = log_level
        self._check_port()          # before anything starts: serve checks it before Triton does
        self.server = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '') else self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "OpenAIServerThread":
        import uvicorn
        from runtime.openai.app import create_app
        from runtime.openai.engine import TritonEngine
        logger = logging.getLogger("runtime.openai")
        if not logger.handlers:             # one line per refused request or disconnect, on stderr
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("openai api: %(message)s"))
            logger.addHandler(handler)
            logger.propagate = False
        logger.setLevel(logging.INFO)
        app = create_app(TritonEngine(self.grpc_url, self.model), self.model, self.tokenizer, self.chat_template)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level=self.log_level, access_log=False,
                                lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="openai-api", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeUserError(f"--openai-port {self.port}: expected the API to start on {self.host}, "
                                       "found it stopped (see the log above); choose another port")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeUserError(f"--openai-port {self.port}: expected the API to listen within "
                                       f"{timeout_s:g} s, found it not listening")
            time.sleep(0.05)
        return self

    def _check_port(self) -> None:
        with socket.socket() as s:
            try:
                s.bind((self.host, self.port))
            except OSError as e:
                raise RuntimeUserError(f"--openai-port {self.port}: expected a free port on {self.host}, found it "
                                       f"taken ({e.strerror}); choose another port") from None

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=15)
        self.server = self.thread = None

    def __enter__(self) -> "OpenAIServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
