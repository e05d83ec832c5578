"""bench.serve --api openai against a tiny in-process OpenAI-compatible server (tests/bench/fake_openai.py:
SSE over chunked HTTP/1.1, kept-alive connections, misbehaving on cue as real servers do). The same client
against llama.cpp's real server: tests/bench/test_llamacpp.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import openai_client, serve
from bench.openai_client import OpenAIClient, StreamResult, split_url
from core.errors import UsageError
from tests.bench.fake_openai import fake  # noqa: F401  (the fixture)


def test_one_request_timed_from_its_chunks_with_usage(fake):
    url, handler = fake()
    assert openai_client.served_model(url) == "generate"
    assert openai_client.served_model(fake(model_id=None)[0]) is None
    with OpenAIClient(url) as client:
        for _ in range(2):      # the second rides the kept-alive connection
            res = client.stream("Once upon a time", 6)
            rec = res.record(0, 6)
            assert rec["error"] is None and rec["counted_by"] == "usage" and rec["chunks"] == 6
            assert len(rec["arrivals"]) == 6 and rec["arrivals"] == sorted(rec["arrivals"]) and rec["sent"] < rec["arrivals"][0]
            assert res.text == " t0 t1 t2 t3 t4 t5" and res.finish_reason == "length"
    body = handler.bodies[0]
    assert (body["path"], body["prompt"], body["max_tokens"], body["temperature"], body["stream"]) == \
        ("/v1/completions", "Once upon a time", 6, 0.0, True)
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert "model" not in body and "min_tokens" not in body


def test_a_kept_alive_connection_the_server_closed_is_sent_again(fake):
    url, handler = fake(hang_up=True)
    with OpenAIClient(url) as client:
        recs = [client.stream("hello", 3).record(0, 3) for _ in range(3)]
    assert [r["error"] for r in recs] == [None, None, None] and len(handler.bodies) == 3
    # a fresh connection that fails is not sent again
    with OpenAIClient("http://127.0.0.1:9") as client:
        assert client.stream("x", 2).error.startswith("ConnectionRefusedError")


def test_tokens_counted_without_usage_and_several_per_chunk(fake):
    url, _ = fake(usage=False, per_chunk=2)
    with OpenAIClient(url, endpoint="chat", model="m") as client:
        res = client.stream("hello", 5)
    # no usage, finish_reason "length": max_tokens; 3 text chunks carried them (2 + 2 + 1)
    assert res.tokens(5) == (5, "length") and len(res.chunk_times) == 3
    rec = res.record(0, 5)
    assert rec["error"] is None and len(rec["arrivals"]) == 5 and rec["arrivals"][-2:] == [res.chunk_times[-1]] * 2
    # without a finish_reason "length" and without usage only the text chunks are known
    assert StreamResult(sent=0.0, chunk_times=[1.0, 2.0], finish_reason="stop").tokens(5) == (2, "chunks")
    over = StreamResult(sent=0.0, chunk_times=[1.0], usage_tokens=6, finish_reason="length").record(0, 5)
    assert over["error"] == "ran over: 6 tokens (counted by usage) for max_tokens 5" and len(over["arrivals"]) == 6
    # usage wins over the chunks, both ways
    assert StreamResult(sent=0.0, chunk_times=[1.0, 2.0, 3.0], usage_tokens=2, finish_reason="length").arrivals(2) == [1.0, 2.0]


def test_errors_are_counted_never_hidden(fake):
    url, _ = fake()
    with OpenAIClient(url) as client:
        busy = client.stream("busy now", 4).record(0, 4)
        assert busy["error"] == "HTTP 503: server busy: 4 running, 0 queued" and busy["arrivals"] == []
        event = client.stream("error please", 4).record(0, 4)
        assert event["error"].startswith("server: model crashed") and "\n" not in event["error"]
        cut = client.stream("cut short", 8).record(0, 8)
        assert cut["error"] == "stream ended without a finish_reason after 2 text chunk(s)" and len(cut["arrivals"]) == 2
        ok = client.stream("fine", 4).record(0, 4)      # the connection still serves after all of that
        assert ok["error"] is None
    # a server that does not honour the force-length field stops early: an error, its tokens still counted
    with OpenAIClient(url, force_length="none") as client:
        early = client.stream("early stop", 8).record(0, 8)
    assert early["error"].startswith("finished early: finish_reason 'stop' after 3 of 8 tokens")
    assert len(early["arrivals"]) == 3
    with OpenAIClient(url, force_length="min_tokens") as client:
        assert client.stream("early stop", 8).record(0, 8)["error"] is None
    with OpenAIClient("http://127.0.0.1:9") as client:          # nothing listens on the discard port
        assert client.stream("x", 2).record(0, 2)["error"].startswith("ConnectionRefusedError")


def test_url_spellings_and_loopback_only():
    assert split_url("http://127.0.0.1:8080") == ("127.0.0.1", 8080, "")
    assert split_url("http://localhost:8080/v1") == ("localhost", 8080, "")
    assert split_url("127.0.0.1:8080/api/v1/") == ("127.0.0.1", 8080, "/api")
    assert split_url("http://[::1]:8080") == ("::1", 8080, "")
    for bad in ("http://10.0.0.1:8080", "https://127.0.0.1:8080", "http://127.0.0.1", "127.0.0.1:99999"):
        with pytest.raises(UsageError):
            split_url(bad)


def test_level_and_bench_serve_cli_report(fake, tmp_path, capsys):
    url, handler = fake()
    level = openai_client.run_level(url, 4, 10, ["a", "busy", "b", "c", "d"], 5)
    recs = level["records"]
    assert len(recs) == 10 and {r["client"] for r in recs} <= {0, 1, 2, 3}
    lv = serve.summarize_level([level], 4)
    assert (lv["completed"], lv["tokens"], lv["errors"]) == (8, 40, {"HTTP 503: server busy: 4 running, 0 queued": 2})
    assert lv["tokens_counted_by"] == {"usage": 8, "chunks": 2}

    out, before = tmp_path / "serve", len(handler.bodies)
    rc = serve.main(["--api", "openai", "--url", url, "--concurrency", "1,4", "--requests", "6", "--rounds", "2",
                     "--max-new-tokens", "4", "--warmup", "1", "--endpoint", "chat", "--model", "peer",
                     "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["api"] == "openai" and results["settings"]["endpoint"] == "chat"
    assert [lv["concurrency"] for lv in results["levels"]] == [1, 4]
    for lv in results["levels"]:
        assert (lv["rounds"], lv["requests"], lv["completed"], lv["tokens"], lv["errors"]) == (2, 12, 12, 48, {})
        assert lv["tokens_counted_by"] == {"usage": 12}
        assert lv["ttft"]["p99_ms"] >= lv["ttft"]["p50_ms"] > 0 and lv["tokens_per_s_rounds"]["min"] > 0
    md = (out / "results.md").read_text()
    assert "OpenAI /v1/chat/completions, streamed" in md and "usage (24 requests)" in md
    assert (out / "serve.png").is_file()
    assert all(b["path"] == "/v1/chat/completions" and b["model"] == "peer" for b in handler.bodies[before:])


def test_bench_serve_refuses_an_unreachable_or_refusing_server(fake, tmp_path, capsys):
    rc = serve.main(["--api", "openai", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "ConnectionRefusedError" in err and not (tmp_path / "a").exists()
    url, _ = fake()
    rc = serve.main(["--api", "openai", "--url", url, "--prompts", str(_write(tmp_path / "p.txt", "busy\n")),
                     "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert rc == 1 and "HTTP 503: server busy" in err and not (tmp_path / "b").exists()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
