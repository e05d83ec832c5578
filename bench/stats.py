"""Statistics for interleaved decode benchmarks: percentiles, per-round ratios, run order, limits.

Pure functions over plain lists of seconds; no clocks, no models (tests/bench/ feeds
them synthetic timings). Conventions:

    round r  runs every runner once, in the order `round_order(names, r)` (rotated by r),
             so no runner always goes first (cold caches) or last (thermal, neighbours).
    ratio    of runner A over baseline B = tokens/s(A) / tokens/s(B), taken PER ROUND
             (same round, minutes apart at most) and summarised as median [min, max].
    limit    removing a share f of a step's time can at best give 1 / (1 - f).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def percentile(values, q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default 'linear' method); nan for no values."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return float("nan")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q is {q}; expected 0..100")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values) -> float:
    return percentile(values, 50)


@dataclass(frozen=True)
class Spread:
    """min / median / max of a set of per-round values."""
    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values) -> "Spread":
        xs = [float(v) for v in values]
        if not xs:
            return cls(float("nan"), float("nan"), float("nan"))
        return cls(min(xs), median(xs), max(xs))

    @property
    def rel_width(self) -> float:
        """(max - min) / median: the run-to-run noise band of this quantity."""
        return (self.max - self.min) / self.median if self.median else float("nan")

    def as_dict(self) -> dict:
        return {"min": self.min, "median": self.median, "max": self.max}


def round_order(names, r: int) -> list:
    """The run order of round r: `names` rotated left by r (round 0 keeps the given order)."""
    names = list(names)
    if not names:
        return []
    k = r % len(names)
    return names[k:] + names[:k]


def schedule(names, rounds: int) -> list[list]:
    """Run order of every round; over len(names) rounds each runner holds each slot once."""
    return [round_order(names, r) for r in range(rounds)]


def tokens_per_s(batch: int, new_tokens: int, total_s: float) -> float:
    """Output tokens per second of one generation: batch x new tokens / (TTFT + all decode steps)."""
    return batch * new_tokens / total_s if total_s > 0 else float("nan")


def per_round_ratios(candidate: list[float], baseline: list[float]) -> list[float]:
    """candidate[r] / baseline[r] for each round r (both tokens/s, same round)."""
    if len(candidate) != len(baseline):
        raise ValueError(f"ratio needs one value per round for both runners, found {len(candidate)} and {len(baseline)}")
    return [c / b if b > 0 else float("nan") for c, b in zip(candidate, baseline)]


def ratio_summary(candidate: list[float], baseline: list[float]) -> Spread:
    """Per-round ratio of tokens/s, as median [min, max]."""
    return Spread.of(per_round_ratios(candidate, baseline))


def tpot_percentiles(step_s, qs=(50, 90, 99)) -> dict[str, float]:
    """TPOT percentiles in seconds, pooled over every decode step of every round."""
    steps = list(step_s)
    return {f"p{q}": percentile(steps, q) for q in qs}


def limit_speedup(f: float) -> float:
    """Best speedup from removing a share f (0 <= f < 1) of the step time: 1 / (1 - f)."""
    if not 0 <= f < 1:
        return float("nan") if not f == f else (float("inf") if f >= 1 else float("nan"))
    return 1.0 / (1.0 - f)


def share_of_limit(ratio: float, limit: float) -> float:
    """Fraction of the possible GAIN realised: (ratio - 1) / (limit - 1); nan when the limit is 1."""
    if not limit > 1:
        return float("nan")
    return (ratio - 1.0) / (limit - 1.0)


def slower_beyond_noise(ratio: Spread, noise_band: float) -> bool:
    """True when even the best round is slower than the baseline by more than the noise band."""
    return ratio.max < 1.0 - noise_band


def bytes_per_s(weight_bytes: int, steps_per_s: float) -> float:
    """Achieved weight bandwidth: every weight is read once per decode step (any batch)."""
    return weight_bytes * steps_per_s
