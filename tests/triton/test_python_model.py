"""The generate model's backend-free core (runtime/triton/python_model.py): streamed text pieces add
up to the text runtime.generate prints, and what one request's client receives per scheduler event."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.scheduler import CANCELLED, ERROR, LENGTH, STOP, Sequence
from runtime.generate import GenerationConfig
from runtime.triton.python_model import Request, ResponseStream, TextStream


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer
    from tests.helpers import tiny_tokenizer_json
    return Tokenizer.from_file(str(tiny_tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer.json")))


def test_pieces_add_up_to_the_text_even_when_tokens_split_characters(tokenizer):
    """Random byte-level tokens (UTF-8 characters split across tokens, invalid bytes, the stop
    token): the pieces concatenated equal decode(all tokens but the stop tokens)."""
    eos = tokenizer.token_to_id("<|endoftext|>")
    multi = tokenizer.encode("héllo wörld ✓ 日本").ids          # multi-byte characters, byte by byte
    rng = np.random.default_rng(0)
    held_back = 0
    for trial in range(300):
        tokens = rng.choice(multi, rng.integers(1, 12)).tolist() if trial % 2 else \
            rng.integers(0, tokenizer.get_vocab_size(), rng.integers(1, 12)).tolist()
        if trial % 5 == 0:
            tokens.insert(len(tokens) // 2, eos)
        text = TextStream(tokenizer, (eos,))
        pieces = [text.push(t, last=i == len(tokens) - 1) for i, t in enumerate(tokens)]
        assert "".join(pieces) == tokenizer.decode([t for t in tokens if t != eos]), tokens
        held_back += sum(1 for p in pieces[:-1] if p == "")
    assert held_back > 0          # some pieces were held back for an incomplete character


def _seq(tokens, finish, error=None, stop=()):
    seq = Sequence([1], GenerationConfig(max_new_tokens=len(tokens) or 1, stop_tokens=stop), listener=lambda s, t: None)
    seq.tokens, seq.finish, seq.error = list(tokens), finish, error
    return seq


def _request(**kw):
    return Request(text_input="Once", max_tokens=32, **kw)


def test_what_a_client_receives(tokenizer):
    ids = tokenizer.encode("Once upon a time").ids
    eos = tokenizer.token_to_id("<|endoftext|>")
    sent = []
    send = lambda *a: sent.append(a)  # noqa: E731 - (outputs, error, final)
    stream = ResponseStream(send, tokenizer, _request(stream=True), (eos,))
    for i, t in enumerate(ids + [eos]):
        seq = _seq((ids + [eos])[:i + 1], STOP if t == eos else None)
        stream.stop_when(t)
        stream.on_event(seq, t)
    assert [s[0]["output_ids"].tolist() for s in sent] == [[t] for t in ids + [eos]]
    assert [s[2] for s in sent] == [False] * len(ids) + [True]
    texts = [s[0]["text_output"].reshape(-1)[0].decode() for s in sent]
    assert "".join(texts) == "Once upon a time" and texts[-1] == ""
    assert [s[0]["text_output"].shape for s in sent] == [(1, 1)] * len(sent)
    assert ["finish_reason" in s[0] for s in sent] == [False] * len(ids) + [True]
    assert sent[-1][0]["finish_reason"].reshape(-1)[0] == b"stop"
    sent.clear()
    whole = ResponseStream(send, tokenizer, _request(return_num_input_tokens=True, return_num_output_tokens=True),
                           (eos,))
    for i, t in enumerate(ids):
        whole.on_event(_seq(ids[:i + 1], LENGTH if i == len(ids) - 1 else None), t)
    assert len(sent) == 1 and sent[0][1:] == (None, True)                    # one response, at the end
    out = sent[0][0]
    assert out["text_output"].reshape(-1)[0] == b"Once upon a time" and out["output_ids"].tolist() == ids
    assert out["finish_reason"].reshape(-1)[0] == b"length"
    assert (out["num_input_tokens"].tolist(), out["num_output_tokens"].tolist()) == ([[1]], [[len(ids)]])
    sent.clear()
    stream.on_event(_seq(ids[:2], CANCELLED, "the client cancelled or disconnected"), None)
    stream.on_event(_seq(ids[:2], ERROR, "internal error in decode: RuntimeError: x"), None)
    assert sent[0] == (None, None, True)                            # an empty final response
    assert sent[1][0] is None and "internal error in decode" in str(sent[1][1]) and sent[1][2]


def test_the_request_takes_exactly_the_contracts_inputs():
    """Request's fields are the config's inputs (llm_tensors.INPUTS): none parsed that the config lacks,
    none in the config that the model would drop."""
    from dataclasses import fields
    from runtime.triton.llm_tensors import INPUT_NAMES
    assert tuple(f.name for f in fields(Request)) == INPUT_NAMES


def test_stop_strings_echo_and_logprobs_in_what_a_client_receives(tokenizer):
    """Streamed: the stop string and what follows never reach the client, the pieces add up to the
    whole response's text, the prompt leads the first piece with exclude_input_in_output false, and each
    response carries its token's logprob [1] and top [1, k]; the whole response carries [n] and [n, k]."""
    ids = tokenizer.encode("the cat sat. the end").ids
    k = 2
    got = {}
    for stream in (True, False):
        sent = []
        req = _request(stream=stream, stop_words=("t. t", "zz"), exclude_input_in_output=False,
                       return_log_probs=True, top_logprobs=k)
        rs = ResponseStream(lambda *a: sent.append(a), tokenizer, req, ())
        seq = Sequence([1], GenerationConfig(max_new_tokens=len(ids), logprobs=k), listener=lambda s, t: None)
        for t in ids:
            seq.tokens.append(t)
            seq.logprobs.append((-0.5, [t, 0], [-0.5, -1.0]))
            if rs.stop_when(t):
                seq.finish = STOP
            elif len(seq.tokens) == len(ids):
                seq.finish = LENGTH
            rs.on_event(seq, t)
            if seq.finish:
                break
        got[stream] = sent
        assert sent[-1][2] and sent[-1][0]["finish_reason"].reshape(-1)[0] == b"stop"
        n = len(seq.tokens) if not stream else 1
        assert all(s[0]["output_log_probs"].shape == (n,) and s[0]["top_log_probs_ids"].shape == (n, k)
                   for s in sent)
    pieces = [s[0]["text_output"].reshape(-1)[0].decode() for s in got[True]]
    whole = got[False][0][0]["text_output"].reshape(-1)[0].decode()
    assert "".join(pieces) == whole == "Once" + "the cat sa"
    assert pieces[0].startswith("Once") and len(got[False]) == 1


@pytest.mark.parametrize("stream", [True, False])
def test_prompt_top_logprobs_on_the_first_response(tokenizer, stream):
    """return_prompt_log_probs with top_logprobs k: the first response carries prompt_top_log_probs_ids /
    prompt_top_log_probs [p, k] (the scheduler's rows) beside prompt_ids and prompt_log_probs; without k,
    neither."""
    k, prompt = 2, [5, 6, 7]
    for top in (k, 0):
        sent = []
        req = _request(stream=stream, return_prompt_log_probs=True, top_logprobs=top)
        rs = ResponseStream(lambda *a: sent.append(a), tokenizer, req, ())
        seq = Sequence(prompt, GenerationConfig(max_new_tokens=2, logprobs=top, prompt_logprobs=True),
                       listener=lambda s, t: None)
        seq.prompt_logprobs = [float("nan"), -1.0, -2.0]
        seq.prompt_top_logprobs = ([[-1, -1], [6, 9], [3, 7]], [[float("nan")] * 2, [-1.0, -1.5], [-0.5, -2.0]])
        for i, t in enumerate((8, 9)):
            seq.tokens.append(t)
            seq.logprobs.append((-0.5, [t, 0][:top], [-0.5, -1.0][:top]))
            seq.finish = LENGTH if i == 1 else None
            rs.on_event(seq, t)
        first = sent[0][0]
        assert first["prompt_ids"].tolist() == prompt
        if top:
            assert first["prompt_top_log_probs_ids"].tolist() == [[-1, -1], [6, 9], [3, 7]]
            np.testing.assert_allclose(first["prompt_top_log_probs"][1:], [[-1.0, -1.5], [-0.5, -2.0]])
            assert first["prompt_top_log_probs"].dtype == np.float32 and np.isnan(first["prompt_top_log_probs"][0]).all()
        else:
            assert "prompt_top_log_probs_ids" not in first and "prompt_top_log_probs" not in first
        assert all("prompt_top_log_probs" not in s[0] for s in sent[1:])
