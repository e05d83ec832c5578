"""Next-token selection from logits [B, V] on the host: greedy, temperature, top-k, top-p, and
OpenAI's frequency and presence penalties (`penalize`, applied to the logits before any of them).

Sampling draws from a numpy Generator the caller seeds once per generation, so a
fixed seed gives the same tokens run to run (and across backends whose logits agree).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0   # 0: greedy (argmax); top_k / top_p ignored
    top_k: int = 0             # 0: no top-k cut
    top_p: float = 1.0         # 1: no nucleus cut
    frequency_penalty: float = 0.0   # OpenAI's: logit -= count of the token in the new tokens * this
    presence_penalty: float = 0.0    # OpenAI's: logit -= this once the token is among the new tokens

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature is {self.temperature}; expected >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k is {self.top_k}; expected >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p is {self.top_p}; expected in (0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} is {getattr(self, name)}; expected in [-2, 2] (OpenAI's range)")

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def penalize(logits: np.ndarray, config: SamplingConfig, generated: list[list[int]]) -> np.ndarray:
    """OpenAI's penalties on logits [B, V] (a new array; logits unchanged): for each token j,
    logit_j -= count_j * frequency_penalty + (count_j > 0) * presence_penalty, where count_j is how
    often j occurs among row b's new tokens so far (generated[b]; the prompt does not count).
    The same arithmetic (float32 logits, the penalty cast to their dtype) wherever it runs,
    so that greedy with penalties gives the same tokens in runtime.generate and the scheduler."""
    out = logits.copy()
    for b, tokens in enumerate(generated):
        if not tokens:
            continue
        ids, counts = np.unique(np.asarray(tokens, np.int64), return_counts=True)
        penalty = counts * config.frequency_penalty + config.presence_penalty                  # float64 [n]
        out[b, ids] -= penalty.astype(out.dtype)
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-softmax over the last axis, in float64 (logprobs of the raw logits)."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def top_logprobs(row: np.ndarray, token: int, k: int) -> tuple[float, list[int], list[float]]:
    """(logprob of token, the k most likely ids best first, their logprobs) from one row of logits [V]."""
    lp = log_softmax(row[None, :])[0]                                                          # [V]
    if k > 0:
        top = np.argpartition(-lp, k - 1)[:k] if k < lp.shape[0] else np.arange(lp.shape[0])
        top = top[np.argsort(-lp[top], kind="stable")]
    else:
        top = np.zeros(0, np.int64)
    return float(lp[token]), top.tolist(), lp[top].tolist()


def sample(logits: np.ndarray, config: SamplingConfig, rng: np.random.Generator | None = None) -> np.ndarray:
    """Token ids int64 [B] from logits [B, V]."""
    if config.greedy:
        return logits.argmax(axis=-1).astype(np.int64)
    x = logits.astype(np.float64) / config.temperature                                        # [B, V]
    v = x.shape[-1]
    if 0 < config.top_k < v:
        kth = np.partition(x, v - config.top_k, axis=-1)[:, v - config.top_k][:, None]          # k-th largest
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=-1, keepdims=True)
    if config.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")                                          # [B, V]
        sorted_p = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p    # mass of the tokens ranked above
        keep_sorted = before < config.top_p                  # always keeps the top token
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    u = rng.random((p.shape[0], 1))                                                          # [B, 1]
    cdf = np.cumsum(p, axis=-1)
    idx = (cdf < u * cdf[:, -1:]).sum(axis=-1)
    return np.minimum(idx, v - 1).astype(np.int64)
