"""The shared stop-string matcher (runtime/text_stream.py) against a brute-force reference: random
byte-level tokens (characters split across tokens) and stop strings that span tokens."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.text_stream import TextStream


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer
    from tests.helpers import tiny_tokenizer_json
    return Tokenizer.from_file(str(tiny_tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer.json")))


def _reference(tokenizer, tokens, eos, stops):
    """(final text, how many tokens were consumed): the first prefix of tokens whose text holds a stop
    string ends it, cut just before the earliest one."""
    ids = []
    for n, t in enumerate(tokens, 1):
        if t != eos:
            ids.append(t)
        text = tokenizer.decode(ids)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[:min(hits)], n
    return tokenizer.decode(ids), len(tokens)


def test_stop_strings_end_the_text_before_them_and_pieces_never_show_one(tokenizer):
    eos = tokenizer.token_to_id("<|endoftext|>")
    words = tokenizer.encode("the cat sat on the mat. héllo wörld ✓ the end").ids
    rng = np.random.default_rng(1)
    stopped = held = 0
    for trial in range(400):
        tokens = rng.choice(words, rng.integers(1, 16)).tolist()
        if trial % 7 == 0:
            tokens.insert(len(tokens) // 2, eos)
        text = tokenizer.decode([t for t in tokens if t != eos])
        # stop strings taken from the text (over token boundaries), plus ones that never occur
        stops = [text[i:i + int(rng.integers(1, 5))] for i in rng.integers(0, max(1, len(text)), 2)] + ["§never"]
        stops = [s for s in stops if s and "\ufffd" not in s]
        want, consumed = _reference(tokenizer, tokens, eos, stops)
        stream = TextStream(tokenizer, (eos,), stops)
        pieces = []
        for n, t in enumerate(tokens, 1):
            pieces.append(stream.push(t))
            if stream.stopped:
                break
        pieces.append(stream.flush())
        assert n == consumed and stream.stopped == (consumed < len(tokens) or want != text), (tokens, stops)
        assert "".join(pieces) == want == stream.text(), (tokens, stops)
        sent = ""
        for p in pieces[:-1]:
            sent += p
            assert not any(s in sent for s in stops)            # a stop string is never shown
        stopped += stream.stopped
        held += sum(1 for p in pieces[:-1] if p == "")
    assert stopped > 100 and held > 0


def test_without_stop_strings_it_is_the_plain_text(tokenizer):
    ids = tokenizer.encode("Once upon a time ✓").ids
    stream = TextStream(tokenizer)
    assert "".join(stream.push(t) for t in ids) + stream.flush() == "Once upon a time ✓" and not stream.stopped
