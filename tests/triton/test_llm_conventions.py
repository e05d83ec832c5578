"""The generate model speaks Triton's LLM conventions (runtime/triton/llm_tensors.py), against a real
Triton server started here:

- the exact requests Triton's OpenAI frontend builds for a non-vLLM model, read from
  triton-inference-server/server at commit e1db8a603d863b1317ee859bdeea2be19959462e:
  python/openai/openai_frontend/engine/utils/triton.py `_create_trtllm_generate_request`
  (every scalar a [1, 1] tensor: text_input [[prompt]], stream np.bool_([[stream]]), max_tokens
  np.int32([[n]]), stop_words [request.stop] ([1, n] strings), top_p / frequency_penalty /
  presence_penalty / temperature np.float32([[x]]), seed np.uint64([[s]]), the echo tensor
  (engine/triton_engine.py picks the input named exclude_input_in_output) np.bool_([[not echo]]),
  return_num_input_tokens / return_num_output_tokens np.bool_([[True]])), sent through tritonclient's
  gRPC stream; what the frontend reads back is checked as it reads it: non-streamed, 1 or 2 responses
  with the last final and the text and usage from the first (`_validate_triton_responses_non_streaming`,
  `_get_output`: text_output holds exactly one string, `_get_usage_from_response`: INT32
  num_input_tokens and num_output_tokens in one response); streamed, usage summed over the responses
  that carry both (`_StreamingUsageAccumulator`);
- Triton's generate extension with text_input + parameters: max_tokens 3 gives 3 tokens, a stop_words
  list works, an unknown parameter is one 400 naming it (a list under a name that is not an input is
  refused by Triton itself, naming it);
- greedy served text with stop strings and penalties equals runtime.generate's (CLI against CLI, HTTP
  and gRPC, streamed and not), and the served logprobs equal runtime.generate's.
"""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from tests.triton.conftest import REPO, require

PROMPT = "Once upon a time there was a little cat"


@pytest.fixture(scope="module")
def server(triton_repo):
    require("pytriton", "the Triton server tests")
    from runtime.triton.server import TritonServer
    srv = TritonServer(triton_repo, host="127.0.0.1").start(timeout_s=90)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def local(triton_build):
    """runtime.generate over the build (greedy, batch 1): (text, tokens, result, finish reason) with stop
    strings cut by the shared matcher."""
    from runtime.generate import GenerationConfig, default_stop_tokens, generate
    from runtime.model_files import load_tokenizer
    from runtime.ort_session import OrtSession
    from runtime.sampling import SamplingConfig
    from runtime.text_stream import TextStream
    tok = load_tokenizer(triton_build)
    session = OrtSession(triton_build, intra_op_threads=1).activate()

    def run(prompt: str, n: int, stop=(), logprobs=None, prompt_logprobs=False, **penalties):
        stops = default_stop_tokens(tok, False)
        config = GenerationConfig(max_new_tokens=n, stop_tokens=stops, sampling=SamplingConfig(**penalties),
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        text = TextStream(tok, stops, stop)
        result = generate(session, [tok.encode(prompt).ids], config, [lambda t: (text.push(t), text.stopped)[1]])
        text.flush()
        reason = "stop" if text.stopped or result.tokens[0][-1] in stops else "length"
        return text.text(), result.tokens[0], result, reason
    run.tok = tok
    yield run
    session.deactivate()


PENALTIES = dict(frequency_penalty=1.5, presence_penalty=0.5)   # the random model repeats one token without


def _stop_string(local) -> str:
    """Two printable characters that first occur a few characters into the greedy text with PENALTIES
    (over a token boundary where the tokens are bytes): the text before them is not empty."""
    text = local(PROMPT, 24, **PENALTIES)[0]
    for i in range(3, len(text) - 1):
        stop = text[i:i + 2]
        if stop.isprintable() and "\ufffd" not in stop and text.find(stop) == i:
            return stop
    raise AssertionError(f"no stop string in {text!r}")


def _frontend_inputs(g, prompt: str, stream: bool, max_tokens: int, stop=None, echo=None, **sampling):
    """tritonclient.grpc InferInputs holding exactly what _create_trtllm_generate_request puts in its
    inputs dict for a CreateCompletionRequest (a chat request sends the same tensors; max_tokens from
    max_completion_tokens). sampling: top_p, frequency_penalty, presence_penalty, seed, temperature."""
    inputs = {"text_input": [[prompt]], "stream": np.bool_([[stream]]), "max_tokens": np.int32([[max_tokens]])}
    if stop:
        if isinstance(stop, str):
            stop = [stop]
        inputs["stop_words"] = [stop]
    for name, make in (("top_p", np.float32), ("frequency_penalty", np.float32), ("presence_penalty", np.float32),
                       ("seed", np.uint64), ("temperature", np.float32)):
        if sampling.get(name) is not None:
            inputs[name] = make([[sampling[name]]])
    if echo is not None:
        inputs["exclude_input_in_output"] = np.bool_([[not echo]])
    inputs["return_num_input_tokens"] = np.bool_([[True]])
    inputs["return_num_output_tokens"] = np.bool_([[True]])
    out = []
    for name, value in inputs.items():
        array = np.array(value, dtype=np.object_) if not isinstance(value, np.ndarray) else value
        if array.dtype == np.object_:
            array = np.vectorize(lambda s: s.encode("utf-8"), otypes=[np.object_])(array)
        dt = {np.dtype(np.object_): "BYTES", np.dtype(np.bool_): "BOOL", np.dtype(np.int32): "INT32",
              np.dtype(np.float32): "FP32", np.dtype(np.uint64): "UINT64"}[array.dtype]
        t = g.InferInput(name, list(array.shape), dt)
        t.set_data_from_numpy(array)
        out.append(t)
    return out


def _stream(server, inputs) -> list:
    """Every response of one request on a gRPC stream (the frontend's async_infer): the InferResults."""
    import tritonclient.grpc as g
    client = g.InferenceServerClient(server.grpc_url)
    answers: queue.SimpleQueue = queue.SimpleQueue()
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("generate", inputs, enable_empty_final_response=True)
        results = []
        while True:
            result, error = answers.get(timeout=60)
            assert error is None, error
            results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return results
    finally:
        client.stop_stream()
        client.close()


def _text(result) -> str:
    a = result.as_numpy("text_output")
    assert a.size == 1, a.shape                        # _to_string: exactly one string
    return a.reshape(-1)[0].decode("utf-8")


def _usage(result):
    """_get_usage_from_response: (prompt, completion) tokens when both INT32 counts are in the response."""
    n_in, n_out = result.as_numpy("num_input_tokens"), result.as_numpy("num_output_tokens")
    if n_in is None or n_out is None:
        return None
    assert n_in.dtype == np.int32 and n_out.dtype == np.int32
    return int(n_in.reshape(-1)[0]), int(n_out.reshape(-1)[0])


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_frontends_requests(server, local, stream):
    import tritonclient.grpc as g
    stop = _stop_string(local)
    n_prompt = len(local.tok.encode(PROMPT).ids)
    cases = [  # (request options, stop, what runtime.generate gives)
        (dict(max_tokens=5), None, local(PROMPT, 5)),
        (dict(max_tokens=24, temperature=0.0, top_p=1.0, seed=7, echo=False, **PENALTIES),
         [stop, "never-there"], local(PROMPT, 24, stop=(stop, "never-there"), **PENALTIES)),
        (dict(max_tokens=24, echo=True, **PENALTIES), stop, local(PROMPT, 24, stop=(stop,), **PENALTIES)),
    ]
    for options, stop_words, (want_text, want_tokens, _, want_reason) in cases:
        results = [r for r in _stream(server, _frontend_inputs(g, PROMPT, stream, stop=stop_words, **options))
                   if r.get_response().outputs]
        finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
        if not stream:
            assert 1 <= len(results) <= 2 and finals[-1], finals        # _validate_triton_responses_non_streaming
            text, usage = _text(results[0]), _usage(results[0])
        else:
            text = "".join(_text(r) for r in results)
            counted = [u for u in map(_usage, results) if u is not None]   # _StreamingUsageAccumulator
            usage = (counted[0][0], sum(c for _, c in counted))
        echo = options.get("echo")
        assert text == (PROMPT if echo else "") + want_text, options
        assert usage == (n_prompt, len(want_tokens)), options
        reason = results[-1].as_numpy("finish_reason").reshape(-1)[0].decode()
        assert reason == want_reason, options
        assert [int(t) for r in results for t in r.as_numpy("output_ids").reshape(-1)] == want_tokens
    assert cases[1][2][3] == "stop" and 3 <= len(cases[1][2][0]) < len(local(PROMPT, 24, **PENALTIES)[0])


def _post(server, body: dict, endpoint: str = "generate"):
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/generate/{endpoint}",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_generate_extension_with_text_input_and_parameters(server, local):
    status, body = _post(server, {"text_input": PROMPT, "parameters": {"max_tokens": 3}})
    answer = json.loads(body)
    assert status == 200 and len(answer["output_ids"]) == 3 and answer["finish_reason"] == "length", body
    assert answer["text_output"] == local(PROMPT, 3)[0]
    stop = _stop_string(local)
    want = local(PROMPT, 24, stop=(stop, "zz"), **PENALTIES)
    status, body = _post(server, {"text_input": PROMPT, "parameters": {"max_tokens": 24, "stop_words": [stop, "zz"],
                                                                       "return_num_output_tokens": True, **PENALTIES}})
    answer = json.loads(body)
    assert status == 200 and answer["text_output"] == want[0] and answer["finish_reason"] == "stop", body
    assert answer["num_output_tokens"] == len(want[1]) < 24
    for parameters, needle in (({"max_tokens": 3, "foo": 1}, "parameter foo: "),
                               ({"max_new_tokens": 3}, "parameter max_new_tokens: "),
                               ({"stop": ["a", "b"]}, "parameter 'stop'")):     # Triton's own converter
        for endpoint in ("generate", "generate_stream"):
            status, body = _post(server, {"text_input": PROMPT, "parameters": parameters}, endpoint)
            assert status == 400 and needle in body and "\n" not in body.strip(), (parameters, endpoint, body)
    status, body = _post(server, {"text_input": PROMPT, "max_new_tokens": 3})                   # top level too
    assert status == 400 and "max_new_tokens" in body and "max_tokens" in body, body


def _cli(args: list[str], remote: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = ["runtime.generate"] if remote is None else ["runtime.triton", "client", *remote]
    return subprocess.run([sys.executable, "-m", *cmd, *args], capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize("protocol,stream", [("http", False), ("http", True), ("grpc", False), ("grpc", True)])
def test_served_text_with_stop_strings_and_penalties_equals_runtime_generate(server, local, triton_build, protocol,
                                                                              stream):
    stop = _stop_string(local)
    url = server.http_url if protocol == "http" else server.grpc_url
    penalties = ["--frequency-penalty", "1.5", "--presence-penalty", "0.5"]     # PENALTIES
    for args in (["--prompt", PROMPT, "--max-new-tokens", "24", "--stop", stop, "--stop", "qq", *penalties],
                 ["--prompt", PROMPT, "--max-new-tokens", "24", *penalties],
                 ["--prompt", PROMPT, "--max-new-tokens", "24", "--stop", "ww"]):       # stops at once: ""
        want = _cli(["--model", str(triton_build), *args])
        got = _cli(args, ["--url", url, "--protocol", protocol, *(["--stream"] if stream else [])])
        assert want.returncode == 0 and got.returncode == 0, (want.stderr, got.stderr)
        assert got.stdout == want.stdout, args
        assert want.stdout.strip() or "ww" in args, args


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_logprobs_equal_runtime_generates(server, local, protocol):
    from runtime.triton.client import generate_remote
    url = server.http_url if protocol == "http" else server.grpc_url
    _, want_tokens, result, _ = local(PROMPT, 6, logprobs=3)
    info: dict = {}
    text, tokens = generate_remote(url, PROMPT, 6, protocol=protocol, logprobs=3, info=info)
    assert tokens == want_tokens and len(info["logprobs"]) == len(tokens)
    for (t, lp, top), (want_lp, want_ids, want_lps) in zip(info["logprobs"], result.logprobs[0]):
        assert abs(lp - want_lp) < 1e-5 and [i for i, _ in top] == want_ids
        np.testing.assert_allclose([v for _, v in top], want_lps, atol=1e-5)
        assert top[0][1] >= lp - 1e-6              # greedy: the chosen token is the most likely


def test_client_logprobs_lines_match_runtime_generates(server, triton_build):
    """`runtime.triton client --logprobs K` prints runtime.generate --logprobs K's lines on stderr, ids and
    logprobs (the client has no tokenizer: no token texts)."""
    import re
    args = ["--prompt", PROMPT, "--max-new-tokens", "5", "--logprobs", "2"]
    want = _cli(["--model", str(triton_build), *args])
    got = _cli(args, ["--url", server.grpc_url, "--protocol", "grpc"])
    assert want.returncode == 0 and got.returncode == 0, (want.stderr, got.stderr)
    lines = [[ln for ln in p.stderr.splitlines() if ln.startswith("logprobs ")] for p in (want, got)]
    assert len(lines[0]) == len(lines[1]) == 5 and all(" | top: " in ln for ln in lines[1])
    for w, g in zip(*lines):
        w = re.sub(r" '(?:[^'\\]|\\.)*'| \"(?:[^\"\\]|\\.)*\"", "", w)        # drop runtime.generate's token texts
        assert [float(x) for x in re.findall(r"-?\d+\.\d{4}", g)] == pytest.approx(
            [float(x) for x in re.findall(r"-?\d+\.\d{4}", w)], abs=2e-4), (w, g)
        assert re.findall(r"(?:: |, |top: )(\d+) ", g) == re.findall(r"(?:: |, |top: )(\d+) ", w), (w, g)


def test_an_input_the_model_does_not_take_is_refused_by_name_over_grpc(server):
    import tritonclient.grpc as g
    inputs = _frontend_inputs(g, PROMPT, False, 3)
    extra = g.InferInput("max_new_tokens", [1, 1], "INT32")
    extra.set_data_from_numpy(np.int32([[3]]))
    client = g.InferenceServerClient(server.grpc_url)
    answers: queue.SimpleQueue = queue.SimpleQueue()
    try:
        client.start_stream(callback=lambda result, error: answers.put(error))
        client.async_stream_infer("generate", inputs + [extra])
        error = answers.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()
    assert error is not None and "max_new_tokens" in str(error) and "\n" not in str(error).strip(), error
