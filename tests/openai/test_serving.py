"""The OpenAI API against a real Triton server: `python -m runtime.triton serve --openai-port` over the
repository of the tiny random DyT build (tests/triton/conftest.py), called with the official openai
client (and AIPerf where it is installed: test_aiperf.py):

- greedy completions and chat equal runtime.generate on the same prompt (chat: on the prompt the chat
  template renders), whole and streamed, over the OpenAI API as over Triton (runtime.triton client);
- usage, finish_reason (length / stop), stop strings (the stop text not returned), logprobs equal to
  runtime.generate's (the raw logits' log-softmax), echo with the prompt's logprobs;
- 16 concurrent streamed requests each equal their solo run;
- bad requests: one error object each, the next answer unchanged; a disconnect cancels its request
  (the model's cancelled counter);
- the serve process logs no traceback and exits 0 on Ctrl-C.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.openai.conftest import require_api
from tests.triton.conftest import CAPACITY, REPO, require

TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
WORDS = "Once upon a time there was a little cat named Tom who liked to play in the garden".split()


def _prompt(n: int, start: int = 0) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def served(triton_build, tmp_path_factory):
    """(api base url, serve process, metrics url, repo): runtime.triton serve --openai-port over the build's
    repository (8 slots), a chat template passed with --chat-template."""
    require("pytriton", "the OpenAI serving tests")
    require_api()
    from runtime.triton import write_triton_repository
    from runtime.triton.server import free_port
    root = tmp_path_factory.mktemp("openai")
    repo = write_triton_repository(triton_build, root / "repo", intra_op_threads=1, slots=8, max_queued=64)
    (root / "t.jinja").write_text(TEMPLATE)
    ports = {k: free_port() for k in ("http", "grpc", "metrics", "openai")}
    proc = subprocess.Popen([sys.executable, "-m", "runtime.triton", "serve", "--repo", str(repo),
                             "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
                             "--metrics-port", str(ports["metrics"]), "--openai-port", str(ports["openai"]),
                             "--chat-template", str(root / "t.jinja")],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=(log_file := open(root / "serve.log", "w")))
    base = f"http://127.0.0.1:{ports['openai']}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (root / "serve.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, (root / "serve.log").read_text()[-3000:]
        time.sleep(0.3)
    yield base, proc, f"127.0.0.1:{ports['metrics']}", repo, ports
    proc.send_signal(signal.SIGINT)
    code = proc.wait(60)
    log_file.close()
    log = (root / "serve.log").read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-5000:]


@pytest.fixture(scope="module")
def local(triton_build):
    """runtime.generate on the build (batch 1): (text, tokens, logprobs rows, prompt logprobs)."""
    from runtime.generate import GenerationConfig, default_stop_tokens, generate
    from runtime.model_files import load_tokenizer
    from runtime.ort_session import OrtSession
    from runtime.sampling import SamplingConfig
    tok = load_tokenizer(triton_build)
    session = OrtSession(triton_build, intra_op_threads=1).activate()

    def run(prompt: str, n: int, logprobs: int | None = None, prompt_logprobs: bool = False, ignore_eos=False):
        config = GenerationConfig(max_new_tokens=n, sampling=SamplingConfig(0.0, 0, 1.0),
                                  stop_tokens=default_stop_tokens(tok, ignore_eos), logprobs=logprobs,
                                  prompt_logprobs=prompt_logprobs)
        result = generate(session, [tok.encode(prompt).ids], config)
        stop = set(config.stop_tokens)
        tokens = result.tokens[0]
        run.stops = stop
        run.prompt_top = result.prompt_top_logprobs[0] if result.prompt_top_logprobs else None
        return (tok.decode([t for t in tokens if t not in stop]), tokens,
                result.logprobs[0] if result.logprobs else None,
                result.prompt_logprobs[0] if result.prompt_logprobs else None)
    run.tok = tok
    yield run
    session.deactivate()


def client(base):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def test_completions_equal_runtime_generate(served, local):
    base, *_ = served
    c = client(base)
    for n_words, n in ((3, 12), (9, 24)):
        prompt = _prompt(n_words)
        want, tokens, _, _ = local(prompt, n)
        r = c.completions.create(model="generate", prompt=prompt, max_tokens=n, temperature=0)
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason == ("stop" if tokens[-1] in local.stops else "length")
        assert r.usage.completion_tokens == len(tokens) and r.usage.prompt_tokens > 0
        chunks = list(c.completions.create(model="generate", prompt=prompt, max_tokens=n, stream=True,
                                           stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == len(tokens)


def test_token_id_prompts_equal_text_prompts(served, local):
    """A prompt as token ids (lm-eval's local-completions default, tokenized_requests=True: [[ids]]) is the
    text prompt's tokens: the same answer, usage and echo logprobs; [ids] too; several lists one choice each."""
    base, *_ = served
    c = client(base)
    prompt = _prompt(6)
    want, tokens, _, prompt_rows = local(prompt, 8, logprobs=2, prompt_logprobs=True)
    ids = local.tok.encode(prompt).ids
    by_text = c.completions.create(model="generate", prompt=prompt, max_tokens=8, logprobs=2, echo=True)
    for given in (ids, [ids]):
        r = c.completions.create(model="generate", prompt=given, max_tokens=8, logprobs=2, echo=True)
        assert r.choices[0].text == prompt + want == by_text.choices[0].text
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(tokens)
        lp = r.choices[0].logprobs
        assert lp.tokens == by_text.choices[0].logprobs.tokens and lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(prompt_rows[1:], abs=1e-4)
        assert lp.top_logprobs == by_text.choices[0].logprobs.top_logprobs
    r = c.completions.create(model="generate", prompt=[ids, ids[:3]], max_tokens=8)
    alone = c.completions.create(model="generate", prompt=ids[:3], max_tokens=8).choices[0].text
    assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == [want, alone]


def test_same_over_triton(served, triton_build):
    """runtime.triton client (Triton's own gRPC stream) gives the text the OpenAI API gives."""
    base, proc, metrics, repo, ports = served
    prompt = _prompt(5, 3)
    remote = subprocess.run([sys.executable, "-m", "runtime.triton", "client", "--url", f"127.0.0.1:{ports['grpc']}",
                             "--protocol", "grpc", "--prompt", prompt, "--max-new-tokens", "16"],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert remote.returncode == 0, remote.stderr
    r = client(base).completions.create(model="generate", prompt=prompt, max_tokens=16)
    assert r.choices[0].text == remote.stdout[:-1]


def test_chat_equals_rendered_completion(served, local):
    base, *_ = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": _prompt(4)}]
    rendered = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    want, tokens, _, _ = local(rendered, 10)
    c = client(base)
    r = c.chat.completions.create(model="generate", messages=messages, max_completion_tokens=10)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(tokens)
    chunks = list(c.chat.completions.create(model="generate", messages=messages, max_tokens=10, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want


def test_stop_string(served, local):
    base, *_ = served
    prompt = _prompt(6)
    full, _, _, _ = local(prompt, 24, ignore_eos=True)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip(f"no usable stop string in {full!r}")
    want = full[:full.index(stop)]
    c = client(base)
    for stream in (False, True):
        if stream:
            chunks = list(c.completions.create(model="generate", prompt=prompt, max_tokens=24, stop=[stop, "zzzz"],
                                               stream=True, extra_body={"ignore_eos": True}))
            text = "".join(ch.choices[0].text for ch in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = c.completions.create(model="generate", prompt=prompt, max_tokens=24, stop=stop,
                                     extra_body={"ignore_eos": True})
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (text, reason) == (want, "stop"), (stop, full)


def test_logprobs_equal_runtime_generate(served, local):
    base, *_ = served
    prompt = _prompt(5)
    _, tokens, rows, prompt_rows = local(prompt, 6, logprobs=3, prompt_logprobs=True)
    c = client(base)
    r = c.chat.completions.create(model="generate", messages=[{"role": "user", "content": prompt}], max_tokens=6,
                                  logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-6) for t in content)   # greedy
    r = c.completions.create(model="generate", prompt=prompt, max_tokens=6, logprobs=3, echo=True)
    lp = r.choices[0].logprobs
    p = len(prompt_rows)
    assert r.choices[0].text.startswith(prompt) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:p] == pytest.approx(prompt_rows[1:], abs=1e-4)
    assert lp.token_logprobs[p:] == pytest.approx([row[0] for row in rows], abs=1e-4)
    assert len(lp.tokens) == len(lp.text_offset) == p + len(tokens)
    # the prompt tokens' alternatives: the top 3 of the prefill's logits there, then the token itself (lm-eval's
    # is_greedy: is the token the most likely one), as runtime.generate computes them
    ids, lps = local.prompt_top
    assert lp.top_logprobs[0] is None and len(ids) == p
    for j in range(1, p):
        alternatives = lp.top_logprobs[j]
        assert sorted(alternatives.values(), reverse=True)[:3] == pytest.approx(lps[j], abs=1e-4)
        assert alternatives[lp.tokens[j]] == pytest.approx(prompt_rows[j], abs=1e-4)
        greedy = max(alternatives, key=alternatives.get) == lp.tokens[j]
        assert greedy == (prompt_rows[j] >= lps[j][0] - 1e-6), j
    # max_tokens 0 with echo: the prompt's logprobs only (lm-eval's log-likelihood requests)
    r = c.completions.create(model="generate", prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    assert r.choices[0].text == prompt and r.usage.completion_tokens == 0
    assert r.choices[0].logprobs.token_logprobs[1:] == pytest.approx(prompt_rows[1:], abs=1e-4)


def test_16_concurrent_streams_equal_solo_runs(served, local):
    base, *_ = served
    jobs = [(_prompt(1 + (5 * i) % 11, i), (4, 9, 17, 30)[i % 4]) for i in range(16)]
    want = [local(p, n)[0] for p, n in jobs]

    def stream(job):
        p, n = job
        chunks = client(base).completions.create(model="generate", prompt=p, max_tokens=n, stream=True)
        return "".join(ch.choices[0].text for ch in chunks)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(stream, jobs))
    assert got == want


def _finished(metrics: str) -> dict[str, float]:
    """The generate model's finished counters by reason, and its running gauge (Prometheus)."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("tapernorm_generate_finished_total") and 'instance="generate_0_0"' in name:
            out[name.split('reason="')[1].split('"')[0]] = float(value)
        elif name.startswith("tapernorm_generate_running{") and 'instance="generate_0_0"' in name:
            out["running"] = float(value)
    return out


def _cancels(metrics: str, attempt) -> None:
    """attempt() starts a long request and goes away while it runs; it must end as cancelled in the model.
    The tiny model may finish its tokens before the client is gone (a loaded machine): that try ends as
    length and is made again, 20 tries at most (5 were not enough once with the load average near 7)."""
    for _ in range(20):
        before = _finished(metrics)
        attempt()
        deadline = time.monotonic() + 10
        while True:
            now = _finished(metrics)
            if now["cancelled"] > before["cancelled"] or now["length"] > before["length"]:
                break
            assert time.monotonic() < deadline, "the request neither ended nor was cancelled"
            time.sleep(0.1)
        if now["cancelled"] > before["cancelled"]:
            return
    pytest.fail("no request was still running when its client went away (20 tries)")


RUNNING_WAIT_S = 0.5      # the request is in the model's queue or running by then (gRPC submits in milliseconds)
# a request long enough to outlive its client's disconnect: the cancellation reaches the scheduler tens to
# hundreds of steps after it (tests/triton/conftest.py), and the portable graph's first third of the capacity
# decodes fast (it attends over the live slots: export/emit.py), so 480 tokens could all run first
LONG_TOKENS = CAPACITY - 32


def test_disconnect_cancels(served):
    """A streamed request whose client closes after the first chunk, and a whole one whose client goes away
    while it runs, both end as cancelled in the model (its Prometheus counter), not by running to length."""
    base, proc, metrics, *_ = served

    def streamed():
        c = client(base)
        it = c.completions.create(model="generate", prompt=_prompt(3), max_tokens=LONG_TOKENS, stream=True,
                                  extra_body={"ignore_eos": True})
        next(iter(it))
        it.close()
        c.close()

    def whole():
        host, port = base[len("http://"):].split(":")
        body = json.dumps({"model": "generate", "prompt": _prompt(3), "max_tokens": LONG_TOKENS, "ignore_eos": True})
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
            # gone once the model runs it, or after RUNNING_WAIT_S: the running gauge is published by a thread
            # that a loaded machine starves, so waiting for it alone let every try run to its length
            deadline = time.monotonic() + RUNNING_WAIT_S
            while _finished(metrics).get("running", 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
    _cancels(metrics, streamed)
    _cancels(metrics, whole)


@pytest.mark.parametrize("body, status, words", [
    ({"model": "generate", "prompt": "x", "max_tokens": 100000}, 400, "capacity"),   # the model's own message
    ({"model": "generate", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "other", "prompt": "x"}, 404, "does not exist"),
    ({"model": "generate", "prompt": "x", "best_of": 3}, 400, "best_of"),
    # token-id prompts: the model's checks (its vocabulary: 320; its capacity: CAPACITY), and the API's
    ({"model": "generate", "prompt": [5, 320, 7], "max_tokens": 4}, 400, "input_ids: expected token ids in [0, 320)"),
    ({"model": "generate", "prompt": [[5] * (CAPACITY + 88)], "max_tokens": 4}, 400, "capacity"),
    ({"model": "generate", "prompt": [5, -1]}, 400, "expected token ids >= 0"),
    ({"model": "generate", "prompt": [[5], "x"]}, 400, "found a mix"),
    ({"model": "generate", "prompt": [[]]}, 400, "at least one token id"),
])
def test_bad_requests(served, body, status, words):
    base, *_ = served
    good = {"model": "generate", "prompt": _prompt(4), "max_tokens": 8}
    before = client(base).completions.create(**good).choices[0].text
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    answer = json.loads(e.value.read())
    assert e.value.code == status and words in answer["error"]["message"], answer
    assert client(base).completions.create(**good).choices[0].text == before


def _aiperf() -> str:
    """The aiperf command: $AIPERF, else aiperf on PATH (it cannot share this environment's pins: it wants
    another transformers; install it into its own venv and put its bin on PATH or in $AIPERF)."""
    import os
    import shutil
    found = os.environ.get("AIPERF") or shutil.which("aiperf")
    if not found:
        pytest.skip("AIPerf not found: install it in its own venv (python -m venv V && V/bin/pip install aiperf) "
                    "and set AIPERF=V/bin/aiperf or put V/bin on PATH")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_aiperf_completes_without_errors(served, triton_build, tmp_path, endpoint):
    """aiperf profile --endpoint-type chat --streaming / completions: a handful of requests, zero errors.
    (A client that must work; figures come from bench.serve.)"""
    base, *_ = served
    aiperf = _aiperf()
    out = tmp_path / "aiperf"
    proc = subprocess.run([aiperf, "profile", "--model", "generate", "--url", base, "--endpoint-type", endpoint,
                           *(["--streaming"] if endpoint == "chat" else []), "--request-count", "6",
                           "--concurrency", "2", "--tokenizer", str(triton_build), "--synthetic-input-tokens-mean",
                           "20", "--output-tokens-mean", "8", "--ui", "none", "--artifact-dir", str(out),
                           "--no-server-metrics"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == 6 and report["error_summary"] == [], report["error_summary"]
    assert report["request_error_rate"]["avg"] == 0


def test_full_scheduler_is_503_with_its_message(triton_build, tmp_path):
    """A repository with one slot and no queue: a second request while one runs is a 503 whose message is the
    scheduler's own ("server busy: ..."), streamed or not; once the first ends, requests are served again."""
    require("pytriton", "the OpenAI serving tests")
    require_api()
    import openai
    from runtime.openai.server import OpenAIServerThread
    from runtime.triton import write_triton_repository
    from runtime.triton.server import TritonServer, free_port
    repo = write_triton_repository(triton_build, tmp_path / "repo", intra_op_threads=1, slots=1, max_queued=0)
    with TritonServer(repo) as server, OpenAIServerThread(repo, server.grpc_url, free_port()) as api:
        c = client(api.url)
        long = c.completions.create(model="generate", prompt=_prompt(3), max_tokens=LONG_TOKENS, stream=True,
                                    extra_body={"ignore_eos": True})
        next(iter(long))
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as e:
                c.completions.create(model="generate", prompt="x", max_tokens=2, stream=stream)
            assert e.value.status_code == 503 and "server busy" in e.value.body["message"], e.value.body
        long.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                assert c.completions.create(model="generate", prompt="x", max_tokens=2).choices[0].text is not None
                break
            except openai.APIStatusError:
                assert time.monotonic() < deadline, "the slot was not freed"
                time.sleep(0.2)
