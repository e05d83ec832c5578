"""models/layerwise.py: the block-by-block reference equals the model run step by step through its cache, with a
session whose steps follow each other run as one forward and a row that begins another row computed once."""
import numpy as np
import pytest
import torch

from core.decode import Step, token_steps
from models.layerwise import layerwise_run, one_forward
from models.weights import model_weights
from tests.helpers import random_model

# a grouped-query, rope, sliding-window model: the masks and positions a merged or packed forward must get right
MODEL = dict(pos_embedding="rope", n_kv_head=2, sliding_window=4, sliding_layers=[1], mlp="swiglu", max_seq_len=40)
MODELS = {"rope-sliding-gqa": MODEL, "learned-positions-layernorm": dict(norm="layernorm", max_seq_len=40)}


def stepwise(model, steps: list[Step]) -> list[dict[str, np.ndarray]]:
    """Decoder.forward one step at a time over its cache: logits per step, the caches written at the end."""
    batch = steps[0].input_ids.shape[0]
    cache = model.cfg.cache_layout().allocate(batch, dtype=next(model.parameters()).dtype)
    outs = []
    with torch.no_grad():
        for s in steps:
            logits, cache = model(torch.from_numpy(s.input_ids), torch.from_numpy(s.position), cache)
            outs.append({"logits": logits.numpy()})
    used = int(max((s.position + s.input_ids.shape[1]).max() for s in steps))
    for i, (k, v) in enumerate(cache):
        outs[-1][f"present_key_{i}"] = k[:, :, :used].numpy()
        outs[-1][f"present_value_{i}"] = v[:, :, :used].numpy()
    return outs


def sessions(vocab: int) -> list[list[Step]]:
    rng = np.random.default_rng(0)
    text = rng.integers(0, vocab, 30)
    random_rows = rng.integers(0, vocab, (2, 8))
    mixed = np.stack([text[:8], rng.integers(0, vocab, 8)])          # row 0 begins the long row; row 1 from slot 2
    gap = [Step(random_rows[:1, :5], np.array([0])), Step(random_rows[:1, 5:6], np.array([7]))]   # a skipped slot
    return [token_steps(random_rows, 5, np.array([0, 2])),
            token_steps(mixed, 5, np.array([0, 2])),
            token_steps(np.stack([text[:8]] * 2), 5),                 # two alike rows, the long row's beginning
            [Step(text[None], np.array([0]))],                        # the long row: one prefill
            token_steps(text[None, :12], 8),
            gap]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layerwise_equals_the_model_step_by_step(dtype, name):
    model = random_model(**MODELS[name]).to(dtype)
    runs = sessions(model.cfg.vocab_size)
    got = layerwise_run(model_weights(model), runs, dtype)
    for steps, outs in zip(runs, got):
        want = stepwise(model, steps)
        assert len(outs) == len(want)
        for o, w in zip(outs, want):
            assert o.keys() == w.keys()
            for name in w:
                assert o[name].shape == w[name].shape and o[name].dtype == np.float32, name
                if dtype == torch.float32:      # summation order alone (one forward against one step at a time)
                    np.testing.assert_allclose(o[name], w[name], atol=1e-5, rtol=0, err_msg=name)
                else:                           # the same float64 values, each rounded to fp32 on the way out
                    np.testing.assert_allclose(o[name], w[name].astype(np.float32), rtol=2 ** -22, atol=0,
                                               err_msg=name)


def test_a_row_begun_by_a_longer_row_keeps_its_own_cache_slots():
    """The mixed session's row 0 is the long row's first 8 tokens: its caches hold those 8 slots and zeros where
    the long row wrote on (slots 8 and 9, which row 1 from slot 2 reaches), as a run of its own leaves them."""
    model = random_model(**MODEL)
    runs = sessions(model.cfg.vocab_size)
    mixed = layerwise_run(model_weights(model), runs)[1][-1]
    key = mixed["present_key_0"]
    assert key.shape[2] == 10
    assert np.all(key[0, :, 8:] == 0) and np.all(key[0, :, :8] != 0)
    assert np.all(key[1, :, :2] == 0) and np.all(key[1, :, 2:] != 0)


def test_one_forward_joins_only_steps_that_follow_each_other():
    ids = np.arange(16).reshape(2, 8)
    joined = one_forward(token_steps(ids, 5, np.array([0, 2])))
    assert len(joined) == 1
    np.testing.assert_array_equal(joined[0].input_ids, ids)
    np.testing.assert_array_equal(joined[0].position, [0, 2])
    gap = [Step(ids[:, :5], np.array([0, 0])), Step(ids[:, 5:6], np.array([6, 5]))]
    assert one_forward(gap) == gap
