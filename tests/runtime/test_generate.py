"""The generation loop: ragged batches equal single runs, seeded sampling, stop tokens, capacity."""
from __future__ import annotations

import numpy as np
import pytest

from core.contract import DecodeContract
from runtime.generate import GenerationConfig, GenerationResult, check_capacity, decode_n_tokens, generate, pad_right
from runtime.ort_session import OrtSession
from runtime.sampling import SamplingConfig
from runtime.session import CapacityError, DecoderSession
from runtime.torch_session import TorchSession
from tests.runtime.greedy import compare_greedy

PROMPTS = [[5, 17, 42], [7, 99, 3, 250, 11, 64, 8], [200], [31, 41, 59, 26, 53]]   # lengths 3, 7, 1, 5


def _session(kind, tiny):
    ckpt, build = tiny
    return OrtSession(build) if kind == "ort" else TorchSession(ckpt)


def test_pad_right():
    ids, lengths = pad_right([[1, 2], [3], [4, 5, 6]], pad_id=0)
    np.testing.assert_array_equal(ids, [[1, 2, 0], [3, 0, 0], [4, 5, 6]])
    np.testing.assert_array_equal(lengths, [2, 1, 3])


@pytest.mark.parametrize("kind", ["ort", "torch"])
def test_ragged_batch_equals_each_prompt_alone(tiny, kind):
    cfg = GenerationConfig(max_new_tokens=12, keep_logits=True)
    with _session(kind, tiny) as s:
        batch = generate(s, PROMPTS, cfg)
        for b, prompt in enumerate(PROMPTS):
            alone = generate(s, [prompt], cfg)
            compared = compare_greedy(alone.tokens[0], [l[0] for l in alone.logits], batch.tokens[b],
                                      [l[b] for l in batch.logits])
            assert compared == 12, f"prompt {b}: only {compared} tokens compared (tie)"


def test_ort_and_torch_greedy_agree(tiny):
    cfg = GenerationConfig(max_new_tokens=20, keep_logits=True)
    with _session("ort", tiny) as o, _session("torch", tiny) as t:
        ro, rt = generate(o, PROMPTS, cfg), generate(t, PROMPTS, cfg)
    for b in range(len(PROMPTS)):
        compare_greedy(rt.tokens[b], [l[b] for l in rt.logits], ro.tokens[b], [l[b] for l in ro.logits])


def test_seeded_sampling_is_reproducible(tiny):
    cfg = lambda seed: GenerationConfig(max_new_tokens=16, seed=seed, sampling=SamplingConfig(1.0, 40, 0.95))
    with _session("ort", tiny) as s:
        a, b, c = generate(s, PROMPTS, cfg(3)), generate(s, PROMPTS, cfg(3)), generate(s, PROMPTS, cfg(4))
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_stop_tokens_end_each_sequence_on_its_own(tiny):
    cfg = GenerationConfig(max_new_tokens=12)
    with _session("ort", tiny) as s:
        free = generate(s, PROMPTS, cfg)
        stop = free.tokens[1][4]                       # a token prompt 1 emits at step 4
        stopped = generate(s, PROMPTS, GenerationConfig(max_new_tokens=12, stop_tokens=(stop,)))
    for b in range(len(PROMPTS)):
        want = free.tokens[b]
        if stop in want:
            want = want[:want.index(stop) + 1]         # the stop token is kept, nothing after it
        assert stopped.tokens[b] == want


def test_metrics(tiny):
    with _session("ort", tiny) as s:
        r = generate(s, PROMPTS, GenerationConfig(max_new_tokens=5))
    assert r.new_tokens == 20 and len(r.step_s) == 4 and r.ttft_s > 0 and r.tokens_per_s > 0
    assert "TTFT" in r.metrics_line() and "TPOT" in r.metrics_line()


def test_capacity_checks():
    check_capacity(48, [40], 8)
    with pytest.raises(CapacityError, match="at most 48 tokens"):
        check_capacity(48, [3, 49], 1)
    with pytest.raises(CapacityError, match="--max-new-tokens 8 or less"):
        check_capacity(48, [40], 9)
    with pytest.raises(CapacityError, match="empty"):
        check_capacity(48, [0], 1)


def test_generate_fills_the_cache_exactly(tiny):
    """prompt + new tokens == capacity runs (the last decode step writes slot capacity - 2)."""
    with _session("ort", tiny) as s:
        cap = s.spec.capacity
        r = generate(s, [[1, 2, 3]], GenerationConfig(max_new_tokens=cap - 3))
    assert len(r.tokens[0]) == cap - 3


class ScriptedSession(DecoderSession):
    """A session without a model: sequence b emits script[b][k] at its k-th new token
    (prefill picks script[b][0]), so stop handling can be checked token by token."""
    backend = "scripted"

    def __init__(self, script: list[list[int]], vocab: int = 16, capacity: int = 64):
        super().__init__()
        self.script, self.vocab, self.capacity = script, vocab, capacity

    def _activate(self):
        self.spec = DecodeContract(n_layer=1, n_kv_head=1, head_dim=1, capacity=self.capacity, vocab_size=self.vocab)

    def _deactivate(self):
        pass

    def _allocate(self, batch):
        self.calls = 0

    def _logits_for(self, k):
        out = np.zeros((len(self.script), self.vocab), np.float32)                            # [B, V]
        for b, s in enumerate(self.script):
            out[b, s[min(k, len(s) - 1)]] = 1.0
        return out

    def _run_prefill(self, ids, position):
        self.calls = 0
        return np.repeat(self._logits_for(0)[:, None], ids.shape[1], axis=1)                   # [B, T, V]

    def _run_decode(self, tokens, position):
        self.calls += 1
        return self._logits_for(self.calls)


def test_stop_tokens_token_by_token():
    """The first new token may itself stop a sequence; each sequence keeps its stop token and
    nothing after it; the loop ends as soon as every sequence has stopped."""
    script = [[9, 9, 9, 9, 9, 9], [1, 9, 9, 9, 9, 9], [3, 4, 1, 5, 5, 5], [3, 4, 5, 6, 7, 1]]
    with ScriptedSession(script) as s:
        r = generate(s, [[2], [2, 3], [4], [5]], GenerationConfig(max_new_tokens=6, stop_tokens=(1,)))
        assert r.tokens == [[9, 9, 9, 9, 9, 9], [1], [3, 4, 1], [3, 4, 5, 6, 7, 1]]
        r = generate(s, [[2], [2, 3], [4], [5]], GenerationConfig(max_new_tokens=4, stop_tokens=(1, 4)))
        assert r.tokens == [[9, 9, 9, 9], [1], [3, 4], [3, 4]]
        assert len(r.step_s) == 3
        script[0][:] = [1] * 6            # every sequence stops by step 2: the loop ends there
        r = generate(s, [[2], [2, 3], [4], [5]], GenerationConfig(max_new_tokens=6, stop_tokens=(1, 4)))
        assert r.tokens == [[1], [1], [3, 4], [3, 4]] and len(r.step_s) == 1 and s.calls == 1


def test_decode_run_is_checked_once_up_front():
    """decode_n_tokens checks the whole run's positions before the first step."""
    with ScriptedSession([[3] * 8]) as s:
        s.reset(1)
        result = GenerationResult(tokens=[[3]], prompt_lengths=[60], ttft_s=0.0, step_s=[], total_s=0.0)
        with pytest.raises(CapacityError, match="capacity"):
            decode_n_tokens(s, np.array([3]), np.array([60]), 6, GenerationConfig(), np.random.default_rng(0), result)
        assert s.calls == 0 and result.tokens == [[3]]


def test_penalties_logprobs_and_stop_when_in_a_batch_equal_each_prompt_alone(tiny):
    """A ragged batch with penalties, logprobs (top 3) and a per-sequence stop_when gives each prompt the
    tokens, logprobs and end it gets alone; stop_when sees each sequence's tokens up to its end only."""
    cfg = GenerationConfig(max_new_tokens=10, logprobs=3, prompt_logprobs=True,
                           sampling=SamplingConfig(frequency_penalty=1.5, presence_penalty=0.5))
    with _session("ort", tiny) as s:
        free = generate(s, PROMPTS, cfg)
        assert any(len(set(t)) > 3 for t in free.tokens)              # the penalties vary the tokens
        ends = {1: free.tokens[1][4], 3: free.tokens[3][2]}           # stop prompts 1 and 3 at a token of theirs
        seen = [[] for _ in PROMPTS]

        def stopper(b):
            return lambda t: (seen[b].append(t), b in ends and t == ends[b])[1]
        batch = generate(s, PROMPTS, cfg, [stopper(b) for b in range(len(PROMPTS))])
        for b, prompt in enumerate(PROMPTS):
            alone = generate(s, [prompt], cfg, [lambda t, b=b: b in ends and t == ends[b]])
            assert batch.tokens[b] == alone.tokens[0] == seen[b], b
            if b in ends:
                assert batch.tokens[b] == free.tokens[b][:free.tokens[b].index(ends[b]) + 1]
            assert [ids for _, ids, _ in batch.logprobs[b]] == [ids for _, ids, _ in alone.logprobs[0]]
            np.testing.assert_allclose([lp for lp, _, _ in batch.logprobs[b]], [lp for lp, _, _ in alone.logprobs[0]],
                                       atol=1e-4)
            assert len(batch.logprobs[b]) == len(batch.tokens[b])
            assert len(batch.prompt_logprobs[b]) == len(prompt) and np.isnan(batch.prompt_logprobs[b][0])
            np.testing.assert_allclose(batch.prompt_logprobs[b][1:], alone.prompt_logprobs[0][1:], atol=1e-4)


@pytest.mark.parametrize("kind", ["ort", "torch"])
def test_prompt_top_logprobs_are_the_torch_models(tiny, kind):
    """prompt_logprobs with logprobs k: each prompt position's k most likely tokens, best first, with the
    log-softmax of the torch model's own logits there (a ragged batch: each prompt's rows its own);
    the first row (nothing predicts the first token) is -1 / NaN; without k there are none."""
    import torch
    from models.checkpoint import load_checkpoint
    model = load_checkpoint(tiny[0]).eval()
    k = 4
    with _session(kind, tiny) as s:
        got = generate(s, PROMPTS, GenerationConfig(max_new_tokens=2, logprobs=k, prompt_logprobs=True))
        assert generate(s, PROMPTS, GenerationConfig(max_new_tokens=2, prompt_logprobs=True)).prompt_top_logprobs == []
    assert len(got.prompt_top_logprobs) == len(PROMPTS)
    for prompt, (ids, lps) in zip(PROMPTS, got.prompt_top_logprobs):
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([prompt]))[0].double(), dim=-1)[:-1]      # [T - 1, V]
        assert len(ids) == len(lps) == len(prompt) and ids[0] == [-1] * k and np.isnan(lps[0]).all()
        top = torch.topk(want, k, dim=-1)
        np.testing.assert_allclose(np.reshape(lps[1:], (-1, k)), top.values.numpy(), atol=1e-4)
        assert ids[1:] == top.indices.tolist()
        # the prompt tokens' own logprobs are the same rows'
        np.testing.assert_allclose(got.prompt_logprobs[PROMPTS.index(prompt)][1:],
                                   want[torch.arange(len(prompt) - 1), prompt[1:]].numpy(), atol=1e-4)
