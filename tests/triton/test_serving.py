"""Serving under load, against a real Triton server started here on 127.0.0.1: the decoupled
generate model's batch scheduler (runtime/scheduler.py) behind gRPC streaming and HTTP.

- 32 concurrent streamed requests (mixed prompt lengths, max tokens, greedy and seeded sampling,
  gRPC and HTTP) each equal their solo local run, while bad requests and mid-stream
  disconnects (a client that cancels, a client process killed) come in between; afterwards
  the pool is empty, exactly the disconnected sequences finished as cancelled, and the server
  still serves;
- "server busy" beyond the pool and its queue (a model with one slot and no queue);
- `runtime.triton client --stream` prints the text piece by piece, the same text as
  `python -m runtime.generate`;
- the server's resident memory (tritonserver and its backend stub together) stays flat over
  RSS_REQUESTS = 500 requests after RSS_WARMUP: it grows less than RSS_BOUND = 4 MiB in one of the
  first RSS_WINDOWS windows of that many requests (the slow variant: 2000 requests, the same bound).
  A leak grows in every window; the allocators' warm-up, which a loaded CI machine stretches past
  RSS_WARMUP (4.7 MiB in CI's first window once; 0.4, 0.2, 0.4, 0.1, 0.1, 0.0 MiB in six windows of
  500 here on two busy cores), settles.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from runtime.triton.python_model import METRICS_PERIOD_S
from tests.runtime.greedy import compare_greedy
from tests.triton.conftest import CAPACITY, REPO, infer_input as _input, local_and_remote, require

START_TIMEOUT_S = 90
SLOTS, MAX_QUEUED = 8, 64
WORDS = "Once upon a time there was a little cat named Tom who liked to play in the garden".split()
# (prompt words, max new tokens, (temperature, top_k, top_p), seed, ignore_eos): 32 mixed requests
REQUESTS = [(1 + (7 * i) % 12, (1, 4, 9, 16, 24, 33, 48, 60)[i % 8],
             ((0.0, 0, 1.0), (0.8, 0, 1.0), (1.0, 20, 0.9), (1.3, 0, 0.6))[i % 4], 100 + i, i % 3 != 0)
            for i in range(32)]
LONG = CAPACITY - 32    # new tokens of a request that must outlive its client's disconnect or a second request
RSS_REQUESTS, RSS_WARMUP, RSS_WINDOWS = 500, 100, 3
RSS_BOUND = 4 << 20     # bytes the server tree may grow over RSS_REQUESTS requests after RSS_WARMUP:
                        # 8 KiB per request; measured growth here is < 1 MiB per 500 requests


def _prompt(n_words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n_words))


@pytest.fixture(scope="module")
def serving(triton_build, tmp_path_factory):
    """A server with `generate` (SLOTS slots, MAX_QUEUED queued) and `generate_tight` (one slot, no
    queue), metrics on."""
    require("pytriton", "the Triton serving tests")
    from runtime.triton import write_triton_repository
    from runtime.triton.server import TritonServer, free_port
    repo = write_triton_repository(triton_build, tmp_path_factory.mktemp("serving") / "repo", intra_op_threads=1,
                                   slots=SLOTS, max_queued=MAX_QUEUED)
    tight = repo / "generate_tight"
    shutil.copytree(repo / "generate", tight)
    config = (tight / "config.pbtxt").read_text().replace('name: "generate"', 'name: "generate_tight"')
    config = config.replace(f'"slots" value {{ string_value: "{SLOTS}"', '"slots" value { string_value: "1"')
    config = config.replace(f'"max_queued" value {{ string_value: "{MAX_QUEUED}"', '"max_queued" value { string_value: "0"')
    (tight / "config.pbtxt").write_text(config)
    server = TritonServer(repo, metrics_port=free_port(), models=("generate", "generate_tight"))
    server.start(timeout_s=START_TIMEOUT_S)
    yield server
    server.stop()
    assert server.proc.poll() is not None
    _assert_group_gone(server.proc.pid)


def _assert_group_gone(pgid: int, timeout_s: float = 10.0) -> None:
    """No process of the server's group (its backend stubs) is left once stop() returns (reaped by init)."""
    import os
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"processes of the server's group {pgid} outlived stop()"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def solo(triton_build):
    """Solo local runs (runtime.generate, batch 1) with the generate model's settings; logits kept for ties."""
    from runtime.generate import GenerationConfig, generate
    from runtime.model_files import load_tokenizer
    from runtime.ort_session import OrtSession
    from runtime.sampling import SamplingConfig
    from runtime.generate import default_stop_tokens as stop_tokens
    tok = load_tokenizer(triton_build)
    session = OrtSession(triton_build, intra_op_threads=1).activate()

    def run(prompt: str, n: int, sampling=(0.0, 0, 1.0), seed: int = 0, ignore_eos: bool = False):
        config = GenerationConfig(max_new_tokens=n, sampling=SamplingConfig(*sampling), seed=seed,
                                  stop_tokens=stop_tokens(tok, ignore_eos), keep_logits=True)
        result = generate(session, [tok.encode(prompt).ids], config)
        stop = set(config.stop_tokens)
        tokens = result.tokens[0]
        return tok.decode([t for t in tokens if t not in stop]), tokens, [row[0] for row in result.logits]
    yield run
    session.deactivate()


def _metrics(server, model: str = "generate") -> dict[str, float]:
    """This model's tapernorm metrics, names shortened: running, waiting, finished.cancelled, ...
    as of now: the model publishes them every METRICS_PERIOD_S, so a read waits two periods first
    (a pool that was read as empty could otherwise be a snapshot taken before the last request came)."""
    time.sleep(2 * METRICS_PERIOD_S)
    out = {}
    for key, value in server.metrics().items():
        if key.startswith("tapernorm_generate_") and f'instance="{model}_0_0"' in key:
            name = key.split("{")[0][len("tapernorm_generate_"):].removesuffix("_total")
            reason = key.split('reason="')[1].split('"')[0] if "reason=" in key else None
            out[f"{name}.{reason}" if reason else name] = value
    return out


def _wait_pool_empty(server, model: str = "generate", timeout_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(server, model)
        if m.get("running") == 0 and m.get("waiting") == 0 or time.monotonic() > deadline:
            return m


def _stream_raw(server, model: str, inputs_of):
    """One request over a raw gRPC stream (inputs built by the test); the InferenceServerException it gets."""
    import queue
    import tritonclient.grpc as g
    client = g.InferenceServerClient(server.grpc_url)
    answers: queue.SimpleQueue = queue.SimpleQueue()
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(model, inputs_of(g))
        return answers.get(timeout=30)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def _killed_client(server, seen_first: threading.Event) -> None:
    """A client process that streams one long request and is killed after its first piece."""
    code = ("import sys\nfrom runtime.triton.client import generate_remote\n"
            f"generate_remote({server.grpc_url!r}, 'Once upon a time', {LONG}, protocol='grpc', ignore_eos=True, "
            "on_text=lambda piece: (print('piece', flush=True), __import__('time').sleep(3600)))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "piece"
        seen_first.set()
    finally:
        proc.kill()
        proc.wait()


def test_32_concurrent_streamed_requests_equal_their_solo_runs(serving, solo):
    from runtime.triton.client import ClientError, StreamingClient, generate_remote
    from tritonclient.utils import InferenceServerException
    before = _metrics(serving)
    pieces: dict[int, list[str]] = {i: [] for i in range(len(REQUESTS))}

    def good(i: int):
        words, n, sampling, seed, ignore_eos = REQUESTS[i]
        options = dict(temperature=sampling[0], top_k=sampling[1], top_p=sampling[2], seed=seed, ignore_eos=ignore_eos)
        if i % 8 == 7:                 # every 8th over HTTP (server-sent events)
            return generate_remote(serving.http_url, _prompt(words), n, on_text=pieces[i].append, **options)
        with StreamingClient(serving.grpc_url) as client:
            return client.generate(_prompt(words), n, on_piece=lambda text, tokens: pieces[i].append(text), **options)

    def cancelling():
        """A client that gives up after 3 tokens: its stream is closed with cancellation."""
        got = []

        def on_piece(text, tokens):
            got.extend(tokens)
            if len(got) == 3:
                raise KeyboardInterrupt       # what Ctrl-C in the middle of a stream does
        with StreamingClient(serving.grpc_url) as client:
            with pytest.raises(KeyboardInterrupt):
                client.generate("Lily saw a big dog", LONG, on_piece=on_piece, ignore_eos=True)
        return got

    bad = {
        "prompt over capacity": (lambda: generate_remote(serving.grpc_url, _prompt(CAPACITY), 4, protocol="grpc"),
                                 "(the cache capacity)"),
        "prompt + new tokens over capacity": (lambda: generate_remote(serving.http_url, "Once", CAPACITY, on_text=print),
                                              f"input max_tokens: expected prompt + new tokens <= {CAPACITY}"),
        "top_p out of range": (lambda: generate_remote(serving.grpc_url, "Once", 4, protocol="grpc", top_p=2.0),
                               "top_p is 2.0"),
        "unknown model": (lambda: generate_remote(serving.grpc_url, "Once", 4, protocol="grpc", model="nope"),
                          "nope"),
    }
    first_piece_seen = threading.Event()
    with ThreadPoolExecutor(40) as pool:
        futures = {i: pool.submit(good, i) for i in range(len(REQUESTS))}
        cancels = [pool.submit(cancelling) for _ in range(2)]
        killed = pool.submit(_killed_client, serving, first_piece_seen)
        for what, (call, needle) in bad.items():           # while the 32 run
            with pytest.raises(ClientError) as e:
                call()
            assert needle in str(e.value) and "\n" not in str(e.value), f"{what}: {e.value}"
        result, error = _stream_raw(serving, "generate", lambda g: [_input(g, "text_input", np.array([[1]], np.int32), "INT32")])
        assert isinstance(error, InferenceServerException) and "expects 'BYTES'" in str(error)
        results = {i: f.result(timeout=300) for i, f in futures.items()}
        assert [len(c.result(timeout=300)) for c in cancels] == [3, 3]
        killed.result(timeout=300)
    assert first_piece_seen.is_set()
    compared = 0
    for i, (words, n, sampling, seed, ignore_eos) in enumerate(REQUESTS):
        text, tokens = results[i]
        want_text, want_tokens, want_logits = solo(_prompt(words), n, sampling, seed, ignore_eos)
        assert "".join(pieces[i]) == text, f"request {i}: streamed pieces do not add up to the text"
        if sampling[0] == 0.0:
            upto = compare_greedy(want_tokens, want_logits, tokens)
            compared += upto
            if upto == len(want_tokens):
                assert text == want_text, f"request {i}"
        else:
            assert tokens == want_tokens and text == want_text, f"request {i} (seeded sampling)"
            compared += len(tokens)
        assert len(pieces[i]) == len(tokens), f"request {i}: expected one streamed response per token"
    assert compared >= 0.9 * sum(len(solo(_prompt(w), n, s, sd, ie)[1]) for w, n, s, sd, ie in REQUESTS)
    after = _wait_pool_empty(serving)
    assert after["running"] == 0 and after["waiting"] == 0, after              # no slot leaked
    assert after["finished.cancelled"] - before.get("finished.cancelled", 0) == 3, after   # 2 cancels + 1 kill
    assert after["finished.error"] == before.get("finished.error", 0), after
    assert generate_remote(serving.grpc_url, "Once upon a time", 8, protocol="grpc")[0] == solo("Once upon a time", 8)[0]


def test_beyond_the_pool_and_its_queue_the_server_is_busy(serving):
    """generate_tight holds one sequence (1 slot, queue 0): a second request while the first runs
    gets 'server busy: ...' at once; once the first ends, requests are served again."""
    from runtime.triton.client import ClientError, StreamingClient, generate_remote
    busy_seen = None
    for _ in range(3):     # the first request must still be running when the second arrives
        with StreamingClient(serving.grpc_url, model="generate_tight") as holder:
            started = threading.Event()
            held = threading.Thread(target=holder.generate, args=("Once upon a time", LONG),
                                    kwargs=dict(ignore_eos=True, on_piece=lambda text, tokens: started.set()))
            held.start()
            assert started.wait(30)
            try:
                generate_remote(serving.grpc_url, "Once", 4, protocol="grpc", model="generate_tight")
            except ClientError as e:
                busy_seen = str(e)
            held.join(60)
        if busy_seen:
            break
    assert busy_seen and "server busy: expected room for one more request, found 1 running and 0 queued" in busy_seen
    assert "\n" not in busy_seen
    assert _wait_pool_empty(serving, "generate_tight")["running"] == 0
    assert len(generate_remote(serving.grpc_url, "Once", 4, protocol="grpc", model="generate_tight",
                               ignore_eos=True)[1]) == 4


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_client_stream_prints_pieces_as_they_arrive(serving, triton_build, protocol):
    args = ["--prompt", "Once upon a time", "--max-new-tokens", "24"]
    url = serving.grpc_url if protocol == "grpc" else serving.http_url
    local, remote = local_and_remote(triton_build, url, protocol, args, "--stream")
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout and local.stdout.strip()
    # the pieces come as separate responses, one per token, in order of arrival
    from runtime.triton.client import StreamingClient
    arrivals = []
    with StreamingClient(serving.grpc_url) as client:
        text, tokens = client.generate("Once upon a time", 24, ignore_eos=True,
                                       on_piece=lambda piece, new: arrivals.append((time.perf_counter(), new)))
    assert [t for _, new in arrivals for t in new] == tokens and len(arrivals) == 24
    assert all(a[0] <= b[0] for a, b in zip(arrivals, arrivals[1:]))


def _rss_load(server, n: int, seed: int) -> None:
    """n mixed requests (half streamed), 16 at a time, each worker on its own gRPC stream."""
    from runtime.triton.client import StreamingClient
    local, clients = threading.local(), []

    def one(i: int):
        if not hasattr(local, "client"):
            local.client = StreamingClient(server.grpc_url)
            clients.append(local.client)
        words, new, sampling, _, ignore_eos = REQUESTS[(i + seed) % len(REQUESTS)]
        stream = (lambda text, tokens: None) if i % 2 else None
        local.client.generate(_prompt(words % 8 + 1), min(new, 16), on_piece=stream, temperature=sampling[0],
                              top_k=sampling[1], top_p=sampling[2], seed=i, ignore_eos=ignore_eos)
    try:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(n)))
    finally:
        for client in clients:
            client.close()


def _check_rss_flat(server, requests: int) -> None:
    """Windows of `requests` requests until one grows the server's RSS less than RSS_BOUND, at most
    RSS_WINDOWS of them."""
    from runtime.process_memory import rss_bytes
    _rss_load(server, RSS_WARMUP, seed=0)
    base0, growth = rss_bytes(server.pids()), []
    for window in range(RSS_WINDOWS):
        base = rss_bytes(server.pids())
        _rss_load(server, requests, seed=1 + window)
        growth.append(rss_bytes(server.pids()) - base)
        if growth[-1] < RSS_BOUND:
            break
    shown = ", ".join(f"{g / 2**20:.2f}" for g in growth)
    print(f"server RSS {base0 / 2**20:.0f} MiB after {RSS_WARMUP} warm-up requests, grew {shown} MiB "
          f"in windows of {requests} more (bound {RSS_BOUND / 2**20:.0f} MiB)")    # shown with pytest -s or -rP
    assert growth[-1] < RSS_BOUND, (f"server RSS grew {shown} MiB in {len(growth)} windows of {requests} requests "
                                    f"(from {base0 / 2**20:.0f} MiB): more than {RSS_BOUND >> 20} MiB in each")
    assert _wait_pool_empty(server)["running"] == 0


def test_server_rss_stays_flat_over_500_requests(serving):
    _check_rss_flat(serving, RSS_REQUESTS)


@pytest.mark.slow
def test_server_rss_stays_flat_over_2000_requests(serving):
    _check_rss_flat(serving, 4 * RSS_REQUESTS)      # the same bound: 2 KiB per request


def test_bench_serve_reports_a_small_run(serving, tmp_path):
    """python -m bench.serve against this server: every request completes, the figures add up,
    the scheduler batched the concurrent clients, and the three files are written."""
    import json
    from bench.serve import main
    out = tmp_path / "serve"
    # 64 new tokens: long enough that the four concurrent clients' requests overlap on a fast, idle machine
    # (with 8, an idle CI machine finished each request before the next arrived: one row per step)
    assert main(["--url", serving.grpc_url, "--concurrency", "1,4", "--requests", "4", "--max-new-tokens", "64",
                 "--metrics-url", serving.metrics_url, "--rounds", "2", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    levels = {lv["concurrency"]: lv for lv in results["levels"]}
    for c, lv in levels.items():
        assert (lv["requests"], lv["completed"], lv["tokens"], lv["errors"]) == (8, 8, 512, {}), c
        assert lv["tokens_per_s"] > 0 and lv["ttft"]["p99_ms"] >= lv["ttft"]["p50_ms"] > 0 and lv["peak_rss_bytes"] > 0
    sched = levels[4]["scheduler"]
    assert sched["decode_steps"] > 0 and sched["rows_running"] / sched["decode_steps"] > 1, sched     # batched
    assert levels[1]["scheduler"]["rows_running"] == levels[1]["scheduler"]["decode_steps"]    # one at a time
    assert set(results["ratios"]) == {"4"} and results["machine"]["loadavg_start"]
    assert "| 4 | 8/8 |" in (out / "results.md").read_text()
    assert (out / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
