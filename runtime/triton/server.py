"""A real Triton Inference Server on this machine: the tritonserver binary the nvidia-pytriton
wheel bundles (with the Python backend only), run over a model repository.

    with TritonServer("repo", http_port=8000, grpc_port=8001) as server:   # start(): bounded wait
        ...                                                                  # stop() on exit

What start() does (pytriton's own launch, minus its proxy models):
- copies the bundled backends folder into a temporary workspace and puts the
  Python-backend stub that matches this interpreter's version at
  backends/python/triton_python_backend_stub (the binary runs from the wheel);
- runs it with --model-control-mode explicit --load-model for each served model (the CPU
  build has no onnxruntime or tensorrt backend, so decoder_onnx / decoder_trt are not
  loaded here), HTTP and gRPC bound to `host` (default 127.0.0.1); metrics off, or with
  `metrics_port` Prometheus metrics on `host`:metrics_port (the generate model's pool gauges;
  no GPU or CPU metrics);
- environment: LD_LIBRARY_PATH gets this interpreter's LIBDIR (the stub links libpython)
  and the wheel's libraries; PATH starts with this interpreter's bin directory (the stub
  runs the first python3 on PATH, venv included: numpy < 2, onnxruntime, tokenizers);
  PYTHONPATH starts with this project, which generate/1/model.py adds to sys.path;
- waits (at most `timeout_s`) until /v2/health/ready answers 200, failing early with the
  server's last log lines if the process exits.
stop() sends SIGINT, waits `exit_timeout_s` + a margin, then kills it. Close clients
first: the server waits for open connections up to its exit timeout.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from runtime.process_memory import process_tree
from runtime.session import MissingExtraError, RuntimeUserError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SERVED_ON_CPU = ("generate",)


class ServerError(RuntimeUserError):
    """The server did not start, or stopped, with the reason from its log."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pytriton_dist() -> tuple[Path, Path, Path]:
    """(bundled tritonserver dir, stub for this Python, wheel's shared libraries dir)."""
    try:
        from pytriton.utils.distribution import get_libs_path, get_root_module_path, get_stub_path
    except ImportError:
        raise MissingExtraError("runtime.triton serve", "triton", "pytriton") from None
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = Path(get_stub_path(version))
    if not stub.is_file():
        raise ServerError(f"{stub}: expected nvidia-pytriton's Python-backend stub for Python {version}, found none; "
                          "use a Python version the wheel supports (3.8 - 3.13)")
    return Path(get_root_module_path()) / "tritonserver", stub, Path(get_libs_path())


def server_env() -> dict[str, str]:
    env = os.environ.copy()
    _, _, libs = pytriton_dist()
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
    # the stub's interpreter is the first python3 on PATH (this one, with its venv); it runs
    # isolated, so generate/1/model.py itself adds PYTHONPATH (this project) to sys.path
    paths = [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


class TritonServer:
    def __init__(self, repo: str | Path, host: str = "127.0.0.1", http_port: int | None = None,
                 grpc_port: int | None = None, metrics_port: int | None = None, models: tuple[str, ...] = SERVED_ON_CPU,
                 exit_timeout_s: int = 5, log_verbose: int = 0, echo_log: bool = False):
        self.repo = Path(repo).resolve()
        self.host = host
        self.http_port = http_port if http_port is not None else free_port(host if host != "0.0.0.0" else "127.0.0.1")
        self.grpc_port = grpc_port if grpc_port is not None else free_port(host if host != "0.0.0.0" else "127.0.0.1")
        self.metrics_port = metrics_port        # None: metrics off
        self.models = tuple(models)
        self.exit_timeout_s = exit_timeout_s
        self.log_verbose = log_verbose
        self.echo_log = echo_log                                 # True: the server logs to our stderr
        self.proc: subprocess.Popen | None = None
        self.workspace: Path | None = None
        self._log = None

    def _url(self, port: int | None) -> str | None:
        """HOST:PORT a client reaches the server at (a server on every address: this machine's loopback)."""
        return None if port is None else f"{'127.0.0.1' if self.host == '0.0.0.0' else self.host}:{port}"

    http_url = property(lambda self: self._url(self.http_port))
    grpc_url = property(lambda self: self._url(self.grpc_port))
    metrics_url = property(lambda self: self._url(self.metrics_port))

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus metrics: 'name{labels}' -> value (needs metrics_port)."""
        if self.metrics_url is None:
            raise ServerError("tritonserver: expected metrics, found them off; start it with metrics_port")
        with urllib.request.urlopen(f"http://{self.metrics_url}/metrics", timeout=5) as r:
            text = r.read().decode()
        samples = (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))
        return {name: float(value) for name, _, value in samples}

    def pids(self) -> list[int]:
        """The server and every process it started (the Python backend stubs), for RSS readings."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        return process_tree(self.proc.pid)

    def _prepare(self) -> Path:
        dist, stub, _ = pytriton_dist()
        ws = Path(tempfile.mkdtemp(prefix="tapernorm-triton-"))
        shutil.copytree(dist / "backends", ws / "backends")
        shutil.copy(stub, ws / "backends" / "python" / "triton_python_backend_stub")
        return ws

    def command(self) -> list[str]:
        dist, _, _ = pytriton_dist()
        ws = self.workspace
        cmd = [str(dist / "bin" / "tritonserver"),
               f"--model-repository={self.repo}", "--model-control-mode=explicit",
               f"--backend-directory={ws / 'backends'}", f"--cache-directory={dist / 'caches'}",
               f"--http-address={self.host}", f"--http-port={self.http_port}",
               f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
               f"--exit-timeout-secs={self.exit_timeout_s}",
               # a unique shared-memory prefix: several servers may run on one machine
               f"--backend-config=python,shm-region-prefix-name=tapernorm{os.getpid()}x{self.http_port}",
               f"--log-verbose={self.log_verbose}"]
        if self.metrics_port is None:
            cmd.append("--allow-metrics=false")
        else:
            cmd += ["--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
                    f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}"]
        cmd += [f"--load-model={m}" for m in self.models]
        return cmd

    def start(self, timeout_s: float = 60.0) -> "TritonServer":
        if not (self.repo / "generate" / "config.pbtxt").is_file() and "generate" in self.models:
            raise ServerError(f"{self.repo}: expected a model repository with generate/config.pbtxt, found none; "
                              "write one with python -m runtime.triton repo --build BUILD --out REPO")
        self.workspace = self._prepare()
        self.log_path = self.workspace / "server.log"
        self._log = None if self.echo_log else open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), env=server_env(), stdout=self._log,
                                     stderr=None if self.echo_log else subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self._cleanup()
                raise ServerError(f"tritonserver: expected it to start, found it exited with code {self.proc.returncode}: "
                                  f"{tail}")
            if self.ready():
                return self
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise ServerError(f"tritonserver: expected ready within {timeout_s:.0f} s, found it not ready: {tail}")
            time.sleep(0.2)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, n: int = 5) -> str:
        if self.echo_log:
            return "see the server log above"
        try:
            lines = Path(self.log_path).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        errors = [ln for ln in lines if ln.startswith("E") or "error" in ln.lower()]
        tail = " | ".join((errors or lines)[-n:])
        if "libpython" in tail:
            tail += (f" (the Python-backend stub links libpython{sys.version_info[0]}.{sys.version_info[1]}.so.1.0: "
                     "use a Python built with --enable-shared, or install the system libpython of that version)")
        return tail

    def stop(self) -> int | None:
        """SIGINT, then wait for the server's exit timeout; kill it if it is still there."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=self.exit_timeout_s + 10)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)   # the server and its backend stubs
                    self.proc.wait()
            # Kill what is left of the server's process group once the server has exited: a Python
            # backend stub can outlive a server that stopped cleanly on SIGINT (seen here: stubs left with
            # parent 1, holding their model, after test servers stopped). The group is the server's own
            # (start_new_session), so nothing else is in it; its id is not reused while a member lives.
            with contextlib.suppress(ProcessLookupError, PermissionError):    # the group is empty: no stub left
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._cleanup()
        return None if self.proc is None else self.proc.returncode

    def _cleanup(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.workspace is not None:
            shutil.rmtree(self.workspace, ignore_errors=True)
            self.workspace = None

    def __enter__(self) -> "TritonServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
