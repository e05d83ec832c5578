"""Greedy, temperature, top-k and top-p selection from logits [B, V]."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.sampling import SamplingConfig, sample


def _logits(b=3, v=50, seed=0):
    return np.random.default_rng(seed).normal(size=(b, v)).astype(np.float32)


def test_greedy_is_argmax():
    x = _logits()
    np.testing.assert_array_equal(sample(x, SamplingConfig()), x.argmax(-1))


def test_same_seed_same_tokens_other_seed_other_tokens():
    x = _logits(b=4, v=200)
    cfg = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9)
    draw = lambda seed: np.stack([sample(x, cfg, rng) for rng in [np.random.default_rng(seed)] for _ in range(20)])
    np.testing.assert_array_equal(draw(7), draw(7))
    assert not np.array_equal(draw(7), draw(8))


def test_top_k_keeps_only_the_k_largest():
    x = _logits(b=2, v=100)
    rng = np.random.default_rng(0)
    top3 = np.argsort(-x, axis=-1)[:, :3]
    for _ in range(200):
        t = sample(x, SamplingConfig(temperature=5.0, top_k=3), rng)
        assert all(t[b] in top3[b] for b in range(2))


def test_top_p_keeps_the_smallest_nucleus():
    # probabilities 0.5, 0.3, 0.15, 0.05: p = 0.7 keeps the first two, p = 0.85 three
    p = np.array([[0.5, 0.3, 0.15, 0.05]])
    x = np.log(p)
    rng = np.random.default_rng(0)
    seen = {int(sample(x, SamplingConfig(1.0, 0, 0.7), rng)[0]) for _ in range(300)}
    assert seen == {0, 1}
    seen = {int(sample(x, SamplingConfig(1.0, 0, 0.85), rng)[0]) for _ in range(300)}
    assert seen == {0, 1, 2}
    assert {int(sample(x, SamplingConfig(1.0, 0, 0.01), rng)[0]) for _ in range(50)} == {0}


def test_temperature_one_follows_the_softmax():
    p = np.array([0.6, 0.3, 0.1])
    x = np.tile(np.log(p), (4000, 1))
    t = sample(x, SamplingConfig(temperature=1.0), np.random.default_rng(0))
    np.testing.assert_allclose(np.bincount(t, minlength=3) / len(t), p, atol=0.03)


@pytest.mark.parametrize("cfg", [SamplingConfig(-1.0), SamplingConfig(1.0, -1), SamplingConfig(1.0, 0, 0.0)])
def test_bad_configs_are_rejected(cfg):
    with pytest.raises(ValueError):
        cfg.validate()


def test_penalties_are_openais():
    """logit_j -= count_j * frequency_penalty + (count_j > 0) * presence_penalty, per row, over that row's
    new tokens; the input is left alone; greedy then picks from the penalized logits."""
    from runtime.sampling import penalize
    logits = np.zeros((2, 6), np.float32)
    cfg = SamplingConfig(frequency_penalty=0.5, presence_penalty=0.25)
    out = penalize(logits, cfg, [[1, 1, 3], []])
    np.testing.assert_array_equal(out[0], [0, -1.25, 0, -0.75, 0, 0])
    np.testing.assert_array_equal(out[1], 0)
    assert out.dtype == np.float32 and not logits.any()
    negative = penalize(logits, SamplingConfig(frequency_penalty=-1.0), [[4], [4, 4]])      # < 0 favours repeats
    assert negative[0].argmax() == 4 and negative[1, 4] == 2.0
    assert cfg.penalized and not SamplingConfig().penalized


@pytest.mark.parametrize("cfg", [SamplingConfig(frequency_penalty=2.5), SamplingConfig(presence_penalty=-2.01)])
def test_penalties_outside_openais_range_are_rejected(cfg):
    with pytest.raises(ValueError, match="expected in \\[-2, 2\\]"):
        cfg.validate()


def test_top_logprobs_are_the_raw_log_softmax():
    from runtime.sampling import top_logprobs
    row = np.log(np.array([0.1, 0.6, 0.3], np.float32))
    lp, ids, lps = top_logprobs(row, 2, 2)
    assert ids == [1, 2] and np.allclose(lps, np.log([0.6, 0.3]), atol=1e-6) and abs(lp - np.log(0.3)) < 1e-6
    assert top_logprobs(row, 0, 0)[1:] == ([], [])
