"""The OpenAI API's routes, request checks, error objects and stream shape, with the official openai
client and raw HTTP, over a scripted engine (tests/openai/conftest.py: FakeEngine)."""
from __future__ import annotations

import http.client
import json
import time
import urllib.request
from urllib.parse import urlparse

import pytest


def post(base: str, path: str, body, raw: bool = False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def client(base):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


def test_models_and_health(fake_api):
    base, _ = fake_api
    with urllib.request.urlopen(base + "/health") as r:
        assert json.loads(r.read()) == {"status": "ok"}
    assert [m.id for m in client(base).models.list()] == ["generate"]


def test_completion_whole_and_streamed(fake_api):
    base, _ = fake_api
    c = client(base)
    r = c.completions.create(model="generate", prompt="one two three", max_tokens=4)
    assert r.choices[0].text == "one two three one" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 4, 7)
    chunks = list(c.completions.create(model="generate", prompt="one two three", max_tokens=4, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "one two three one"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(ch.usage is None for ch in chunks[:-1])


def test_sse_wire_format(fake_api):
    base, _ = fake_api
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"model": "generate", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2, "stream": True}),
        {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    events = [e for e in r.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_chat_renders_template_and_logprobs(fake_api):
    base, engine = fake_api
    r = client(base).chat.completions.create(model="generate", messages=[{"role": "user", "content": "a bb"}],
                                             max_completion_tokens=3, logprobs=True, top_logprobs=2)
    assert engine.seen[-1].prompt == "user: a bb\nassistant:" and engine.seen[-1].max_tokens == 3
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ["<5>", "<1>", "<2>"]    # FakeTokenizer's text of each id
    assert content[0].logprob == -0.5 and [t.token for t in content[0].top_logprobs] == ["<5>", "<99>"]


def test_completion_echo_logprobs(fake_api):
    """echo + logprobs (lm-eval's log-likelihood request): the prompt's tokens first, the first one null."""
    base, _ = fake_api
    r = client(base).completions.create(model="generate", prompt="aa b", max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "aa b" and lp.tokens == ["<2>", "<1>"]
    assert lp.token_logprobs == [None, -2.0] and lp.text_offset == [0, 3]
    assert r.usage.completion_tokens == 0


def test_token_id_prompts_reach_the_model_as_ids(fake_api):
    """[ids] and [[ids], [ids]] (lm-eval's tokenized_requests): one choice each, sent as input_ids (prompt_ids),
    echoed as their decoded text."""
    base, engine = fake_api
    r = client(base).completions.create(model="generate", prompt=[[7, 8], [9]], max_tokens=1, echo=True)
    sent = engine.seen[-2:]
    assert sorted(g.prompt_ids for g in sent) == [[7, 8], [9]]
    assert sorted(ch.text.split(" ")[0] for ch in r.choices) == ["<7><8><7><8>", "<9><9>"]   # FakeEngine echoes words
    client(base).completions.create(model="generate", prompt=[4, 5], max_tokens=1)
    assert engine.seen[-1].prompt_ids == [4, 5]


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model", "does not exist"),
    ("/v1/completions", {"model": "generate", "prompt": "x", "n": 2}, 400, "n", "expected 1"),
    ("/v1/completions", {"model": "generate", "prompt": "x", "temperature": -1}, 400, "temperature", "greater"),
    ("/v1/completions", {"model": "generate", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"model": "generate", "prompt": "x", "bogus": 1}, 400, "bogus", "Unrecognized"),
    ("/v1/completions", {"model": "generate", "prompt": [[1, 2], "x"]}, 400, "prompt", "found a mix"),
    ("/v1/completions", {"model": "generate", "prompt": [1, -2]}, 400, "prompt", "token ids >= 0"),
    ("/v1/completions", {"model": "generate", "prompt": [[1], []]}, 400, "prompt", "at least one token id"),
    ("/v1/completions", {"model": "generate"}, 400, "prompt", "required"),
    ("/v1/completions", {"model": "generate", "prompt": "BAD"}, 400, None, "capacity"),
    ("/v1/completions", {"model": "generate", "prompt": "BUSY"}, 503, None, "server busy"),
    ("/v1/completions", {"model": "generate", "prompt": "BUSY", "stream": True}, 503, None, "server busy"),
    ("/v1/chat/completions", {"model": "generate", "messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"model": "generate", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, None, "logprobs true"),
    ("/v1/chat/completions", {"model": "generate", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages", "text only"),
    ("/v1/nothing", {}, 404, None, "no such route"),
])
def test_bad_requests_are_one_error_object(fake_api, path, body, status, param, words):
    base, _ = fake_api
    code, text = post(base, path, body)
    error = json.loads(text)["error"]
    assert code == status and words in error["message"] and error["param"] == param, text
    assert set(error) == {"message", "type", "param", "code"}
    # the server's next answer is unchanged
    assert post(base, "/v1/completions", {"model": "generate", "prompt": "ok", "max_tokens": 1})[0] == 200


def test_not_json(fake_api):
    base, _ = fake_api
    code, text = post(base, "/v1/completions", b"{not json", raw=True)
    assert code == 400 and "JSON" in json.loads(text)["error"]["message"]


def test_openai_client_raises_its_error_types(fake_api):
    import openai
    base, _ = fake_api
    with pytest.raises(openai.NotFoundError):
        client(base).completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="Unrecognized"):
        client(base).completions.create(model="generate", prompt="x", extra_body={"bogus": 1})


def test_disconnect_cancels(fake_api):
    """A client that goes away, mid-stream or while waiting for a whole answer, cancels its request."""
    base, engine = fake_api
    u = urlparse(base)
    for stream in (True, False):
        prompt = f"SLOW {stream}"
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"model": "generate", "prompt": prompt, "stream": stream}),
                     {"Content-Type": "application/json"})
        if stream:
            r = conn.getresponse()
            assert r.status == 200 and r.readline().startswith(b"data: ")
        else:
            time.sleep(0.5)
        conn.sock.close()
        conn.close()
        deadline = time.monotonic() + 5
        while prompt not in engine.cancelled:
            assert time.monotonic() < deadline, f"stream={stream}: the request was not cancelled"
            time.sleep(0.05)


def test_error_mid_stream_is_one_event_then_done(fake_api):
    """An error after the first chunk (the status is sent already): one data event with the error object, then
    [DONE]; the server's next answer is unchanged."""
    base, _ = fake_api
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": "generate", "prompt": "FAILMID x", "stream": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    events = [e for e in r.read().decode().split("\n\n") if e]
    assert r.status == 200 and len(events) == 3, events
    assert json.loads(events[0][6:])["choices"][0]["text"] == "FAILMID"
    assert json.loads(events[1][6:])["error"]["message"].startswith("internal error") and events[2] == "data: [DONE]"
    assert post(base, "/v1/completions", {"model": "generate", "prompt": "ok", "max_tokens": 1})[0] == 200


def test_list_of_prompts_one_choice_each(fake_api):
    """prompt as a list of texts (lm-eval's batched requests): one choice per prompt, index in order, whole and
    streamed (the streamed choices interleaved as they come, each with its index)."""
    base, _ = fake_api
    c = client(base)
    r = c.completions.create(model="generate", prompt=["a b", "c d e"], max_tokens=2)
    assert [(ch.index, ch.text) for ch in r.choices] == [(0, "a b"), (1, "c d")]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 4
    texts = {0: "", 1: ""}
    for chunk in c.completions.create(model="generate", prompt=["a b", "c d e"], max_tokens=2, stream=True):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {0: "a b", 1: "c d"}
