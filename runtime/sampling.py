"""Next-token selection from logits [B, V] on the host: greedy, temperature, top-k, top-p.

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

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature is {self.temperature}; expected >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k is {self.top_k}; expected >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p is {self.top_p}; expected in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
