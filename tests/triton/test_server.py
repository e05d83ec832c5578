"""A real Triton server (the tritonserver bundled with nvidia-pytriton) over the repository,
started on 127.0.0.1 by the test itself and stopped at the end (bounded both ways).

Compared with local generation: the CLI output of `python -m runtime.triton client` over
HTTP and gRPC equals `python -m runtime.generate`; 8 concurrent sequences of 64 tokens
(batched together by the generate model's scheduler) equal their solo local results; bad
requests get a Triton error and the server keeps serving. Serving under load:
test_serving.py.
"""
from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.runtime.greedy import compare_greedy
from tests.triton.conftest import CAPACITY, REPO, infer_input as _input, local_and_remote, require

START_TIMEOUT_S = 60
PROMPTS = ["Once upon a time", "Tom liked to play", "One day the sun was warm", "Lily saw a big dog",
           "The birds sang in the tall tree", "They were happy friends", "a little cat named Tom", "red ball"]


@pytest.fixture(scope="module")
def server(triton_repo):
    require("pytriton", "the Triton server tests")
    from runtime.triton.server import TritonServer
    t0 = time.monotonic()
    srv = TritonServer(triton_repo, host="127.0.0.1").start(timeout_s=START_TIMEOUT_S)
    srv.started_in_s = time.monotonic() - t0
    yield srv
    t0 = time.monotonic()
    srv.stop()
    assert srv.proc.poll() is not None, "tritonserver still running after stop()"
    assert time.monotonic() - t0 < srv.exit_timeout_s + 10


@pytest.fixture(scope="module")
def local(triton_build):
    """Solo local generation (runtime.generate over the build's ORT session), batch 1."""
    from runtime.generate import GenerationConfig, generate
    from runtime.model_files import load_tokenizer
    from runtime.ort_session import OrtSession
    tok = load_tokenizer(triton_build)
    session = OrtSession(triton_build, intra_op_threads=1).activate()

    def run(prompt: str, n: int, logits: bool = False):
        """(text, tokens), and with logits=True the [V] logits of each token as a third item (for ties)."""
        result = generate(session, [tok.encode(prompt).ids], GenerationConfig(max_new_tokens=n, keep_logits=logits))
        tokens = result.tokens[0]
        return (tok.decode(tokens), tokens) + (([row[0] for row in result.logits],) if logits else ())
    yield run
    session.deactivate()


def test_server_started_on_localhost_in_bounded_time(server):
    assert server.started_in_s < START_TIMEOUT_S and server.ready()
    log = server.log_path.read_text()
    assert f"Started HTTPService at 127.0.0.1:{server.http_port}" in log
    assert f"Started GRPCInferenceService at 127.0.0.1:{server.grpc_port}" in log
    assert "generate: decoding with ort-cpu (ONNX Runtime CPUExecutionProvider" in log     # generate's backend, logged


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_client_cli_prints_what_local_generate_prints(server, triton_build, protocol):
    args = ["--prompt", "Once upon a time", "--max-new-tokens", "24"]
    url = server.http_url if protocol == "http" else server.grpc_url
    local, remote = local_and_remote(triton_build, url, protocol, args)
    assert local.returncode == 0, local.stderr
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout and local.stdout.strip()


def test_eight_concurrent_sequences_equal_their_solo_results(server, local):
    from runtime.triton.client import generate_remote

    def one(i: int):
        url, protocol = (server.http_url, "http") if i % 2 == 0 else (server.grpc_url, "grpc")
        return generate_remote(url, PROMPTS[i], 64, protocol=protocol, ignore_eos=True)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for prompt, (text, tokens) in zip(PROMPTS, results):     # batched now: equal up to a near-tie (greedy.py)
        want_text, want_tokens, want_logits = local(prompt, 64, logits=True)
        assert len(tokens) == 64
        if compare_greedy(want_tokens, want_logits, tokens) == 64:
            assert text == want_text, prompt


def _raw_request(server, protocol: str, model: str, body):
    """One hand-made request: gRPC stream with InferInputs from body(tritonclient.grpc), or a JSON
    body POSTed to HTTP's generate endpoint. Returns the server's error message (or None)."""
    if protocol == "http":
        import json
        import urllib.error
        import urllib.request
        request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/generate",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return json.loads(r.read()).get("error")
        except urllib.error.HTTPError as e:
            return json.loads(e.read()).get("error")
    import queue
    import tritonclient.grpc as g
    client = g.InferenceServerClient(server.grpc_url)
    answers: queue.SimpleQueue = queue.SimpleQueue()
    try:
        client.start_stream(callback=lambda result, error: answers.put(error))
        client.async_stream_infer(model, body(g))
        error = answers.get(timeout=30)
        return None if error is None else str(error)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, local, protocol):
    from runtime.triton.client import ClientError, generate_remote
    url = server.http_url if protocol == "http" else server.grpc_url
    grpc_bad = {
        "wrong dtype": ("generate", lambda m: [_input(m, "text_input", np.array([[1]], np.int32), "INT32")],
                        "data-type is 'INT32', but model 'generate' expects 'BYTES'"),
        "wrong shape": ("generate", lambda m: [_input(m, "text_input", np.array([[b"a", b"b"]], np.object_), "BYTES")],
                        "unexpected shape for input 'text_input' for model 'generate'. Expected [1,1], got [1,2]"),
        "unknown model": ("no_such_model", lambda m: [_input(m, "text_input", np.array([[b"a"]], np.object_), "BYTES")],
                          "unknown model: 'no_such_model'"),
    }
    http_bad = {
        "wrong dtype": ("generate", {"text_input": 1}, "attempt to access JSON non-string as string"),
        "wrong shape": ("generate", {"text_input": ["a", "b"]}, "can not convert input 'text_input' to tensor with proper shape"),
        "unknown model": ("no_such_model", {"text_input": "a"}, "unknown model: 'no_such_model'"),
    }
    with ThreadPoolExecutor(2) as pool:
        # a good sequence runs while the bad requests come in
        good_future = pool.submit(generate_remote, url, PROMPTS[0], 32, protocol=protocol, ignore_eos=True)
        for what, (model, body, needle) in (http_bad if protocol == "http" else grpc_bad).items():
            error = _raw_request(server, protocol, model, body)
            assert error is not None and needle in error, f"{what}: {error}"
        with pytest.raises(ClientError) as e:
            generate_remote(url, "Once upon a time " * (CAPACITY // 4), 8, protocol=protocol)     # > cache capacity
        assert "cache capacity" in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(ClientError) as e:
            generate_remote(url, "Once upon a time", CAPACITY - 2, protocol=protocol)          # prompt + new > capacity
        assert "input max_tokens: expected prompt + new tokens" in str(e.value)
        assert good_future.result(timeout=60) == local(PROMPTS[0], 32)
    assert generate_remote(url, PROMPTS[1], 8, protocol=protocol, ignore_eos=True) == local(PROMPTS[1], 8)
    # the decoupled model is served over streams and HTTP's generate endpoint; unary infer says so
    import tritonclient.grpc as g
    import tritonclient.http as h
    from tritonclient.utils import InferenceServerException
    m = h if protocol == "http" else g
    client = m.InferenceServerClient(url)
    try:
        with pytest.raises(InferenceServerException, match="decoupled"):
            client.infer("generate", [_input(m, "text_input", np.array([[b"a"]], np.object_), "BYTES")])
    finally:
        client.close()


def test_decoder_configs_pass_the_servers_own_validation(server):
    """The CPU server has no onnxruntime / tensorrt backend, so it cannot run decoder_onnx or
    decoder_trt; but it parses and validates their configs when it polls the repository,
    and only then fails on the missing backend library."""
    import tritonclient.http as h
    from tritonclient.utils import InferenceServerException
    client = h.InferenceServerClient(server.http_url)
    try:
        for model, backend in (("decoder_onnx", "onnxruntime"), ("decoder_trt", "tensorrt")):
            with pytest.raises(InferenceServerException) as e:
                client.load_model(model)
            assert f"unable to find backend library for backend '{backend}'" in str(e.value), str(e.value)
        # the same validation does reject a bad sequence config (two START controls)
        from google.protobuf.json_format import MessageToJson
        from runtime.triton.repository import parse_config
        bad = parse_config((server.repo / "decoder_onnx" / "config.pbtxt").read_text())
        bad.sequence_batching.control_input[1].control[0].kind = bad.sequence_batching.control_input[0].control[0].kind
        with pytest.raises(InferenceServerException) as e:
            client.load_model("decoder_onnx", config=MessageToJson(bad, preserving_proto_field_name=True))
        assert "failed to poll from model repository" in str(e.value)        # the reason is in the log:
        assert "sequence batching specifies multiple CONTROL_SEQUENCE_START tensors" in server.log_path.read_text()
        assert client.is_model_ready("generate")
    finally:
        client.close()


def test_serve_command_starts_and_stops_on_ctrl_c(triton_repo, tmp_path):
    """python -m runtime.triton serve: ready on 127.0.0.1, SIGINT stops it with exit code 0."""
    require("pytriton", "the Triton server tests")
    import signal
    from runtime.triton.client import generate_remote
    from runtime.triton.server import free_port
    http, grpc = free_port(), free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.triton", "serve", "--repo", str(triton_repo),
                             "--http-port", str(http), "--grpc-port", str(grpc), "--startup-timeout", str(START_TIMEOUT_S)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S + 5
        while True:
            try:
                text, tokens = generate_remote(f"127.0.0.1:{http}", PROMPTS[2], 4, ignore_eos=True)
                break
            except Exception:
                assert proc.poll() is None and time.monotonic() < deadline, "serve did not come up"
                time.sleep(0.5)
        assert len(tokens) == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert f"serving {triton_repo}: http 127.0.0.1:{http}, grpc 127.0.0.1:{grpc}" in (tmp_path / "serve.log").read_text()
    finally:
        log.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
