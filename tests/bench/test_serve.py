"""bench.serve's pure parts on synthetic timings: the level figures, the per-round ratio, loopback only.
The load generator itself runs against a real server in tests/triton/test_serving.py."""
from __future__ import annotations

import pytest

from bench.serve import check_loopback, default_requests, listening_pid, round_tokens_per_s, summarize_level
from core.errors import UsageError


def _round(start: float, requests: list[tuple[float, list[float], str | None]]) -> dict:
    records = [{"client": 0, "sent": sent, "arrivals": arrivals, "error": error} for sent, arrivals, error in requests]
    return {"start": start, "end": max(a[-1] for _, a, _ in requests if a), "records": records}


def test_level_figures_from_synthetic_timings():
    # round 1: two requests of 3 tokens, 2 s from the first send to the last token -> 3 tok/s
    r1 = _round(0.0, [(0.0, [0.5, 0.6, 0.8], None), (0.1, [1.0, 1.5, 2.0], None)])
    # round 2: one request of 2 tokens and one refused (no tokens) in 1 s -> 2 tok/s
    r2 = _round(10.0, [(10.0, [10.2, 11.0], None), (10.0, [], "server busy: ...")])
    assert round_tokens_per_s(r1) == pytest.approx(3.0) and round_tokens_per_s(r2) == pytest.approx(2.0)
    lv = summarize_level([r1, r2], concurrency=2)
    assert (lv["requests"], lv["completed"], lv["tokens"]) == (4, 3, 8)
    assert lv["wall_s"] == pytest.approx(3.0) and lv["tokens_per_s"] == pytest.approx(8 / 3)
    assert lv["tokens_per_s_rounds"] == pytest.approx({"min": 2.0, "median": 2.5, "max": 3.0})
    assert lv["requests_per_s"] == pytest.approx(1.0)
    # TTFT: 0.5, 0.9, 0.2 s; inter-token gaps: 0.1, 0.2, 0.5, 0.5, 0.8 s
    assert lv["ttft"]["p50_ms"] == pytest.approx(500.0)
    assert lv["itl"]["p50_ms"] == pytest.approx(500.0) and lv["itl"]["p99_ms"] == pytest.approx(788.0)
    assert lv["errors"] == {"server busy: ...": 1}


def test_loopback_only_and_defaults():
    for url in ("127.0.0.1:8001", "localhost:8001", "[::1]:8001"):
        assert check_loopback(url) == url
    with pytest.raises(UsageError, match="loopback servers only"):
        check_loopback("10.1.2.3:8001")
    assert [default_requests(c) for c in (1, 4, 16)] == [8, 16, 64]


def test_listening_pid_finds_this_process():
    import os
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listening_pid(port) == os.getpid()
    assert listening_pid(port) is None
