"""bench.stats on synthetic timings: percentiles, per-round ratios, run order, limits. No speed is asserted."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import stats

finite = st.floats(min_value=1e-6, max_value=1e3, allow_nan=False, allow_infinity=False)


@given(st.lists(finite, min_size=1, max_size=60), st.floats(min_value=0, max_value=100))
@settings(max_examples=200, deadline=None)
def test_percentile_matches_numpy_linear(values, q):
    assert stats.percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-12)


def test_percentile_known_values():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]            # order must not matter
    assert stats.percentile(xs, 0) == 1.0
    assert stats.percentile(xs, 50) == 3.0
    assert stats.percentile(xs, 100) == 5.0
    assert stats.percentile(xs, 90) == pytest.approx(4.6)
    assert stats.percentile([7.0], 99) == 7.0
    assert math.isnan(stats.percentile([], 50))
    with pytest.raises(ValueError):
        stats.percentile(xs, 101)


def test_tpot_percentiles_of_a_step_list_with_one_slow_step():
    steps = [0.010] * 99 + [0.100]             # one hiccup: p50/p90 untouched, p99 sees it
    p = stats.tpot_percentiles(steps)
    assert p["p50"] == pytest.approx(0.010)
    assert p["p90"] == pytest.approx(0.010)
    assert 0.010 < p["p99"] < 0.100


def test_spread_and_noise_band():
    s = stats.Spread.of([90.0, 100.0, 110.0])
    assert (s.min, s.median, s.max) == (90.0, 100.0, 110.0)
    assert s.rel_width == pytest.approx(0.2)
    assert s.as_dict() == {"min": 90.0, "median": 100.0, "max": 110.0}
    assert math.isnan(stats.Spread.of([]).median)


def test_ratios_are_taken_per_round_not_of_medians():
    # the candidate is 10 % faster in every round while the machine drifts 2x between rounds
    base = [100.0, 50.0, 200.0]
    cand = [110.0, 55.0, 220.0]
    r = stats.ratio_summary(cand, base)
    assert (r.min, r.median, r.max) == pytest.approx((1.1, 1.1, 1.1))
    assert stats.per_round_ratios([2.0], [0.0])[0] != stats.per_round_ratios([2.0], [0.0])[0]  # nan
    with pytest.raises(ValueError):
        stats.per_round_ratios([1.0, 2.0], [1.0])


@given(st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=8, unique=True), st.integers(0, 50))
def test_round_order_is_a_rotation(names, r):
    order = stats.round_order(names, r)
    assert sorted(order) == sorted(names)
    k = r % len(names)
    assert order == names[k:] + names[:k]


def test_schedule_puts_every_runner_in_every_slot_once():
    names = ["strong", "plain", "taper", "fused", "all", "dyt"]
    sched = stats.schedule(names, len(names))
    assert sched[0] == names
    for slot in range(len(names)):
        assert sorted(rnd[slot] for rnd in sched) == sorted(names)
    assert stats.schedule([], 3) == [[], [], []]


def test_tokens_per_s_counts_batch_and_new_tokens():
    assert stats.tokens_per_s(8, 128, 2.0) == 512.0
    assert math.isnan(stats.tokens_per_s(1, 1, 0.0))


def test_limit_speedup_and_share_of_limit():
    assert stats.limit_speedup(0.0) == 1.0
    assert stats.limit_speedup(0.2) == pytest.approx(1.25)
    assert stats.limit_speedup(1.0) == math.inf
    assert math.isnan(stats.limit_speedup(float("nan")))
    assert stats.share_of_limit(1.225, 1.25) == pytest.approx(0.9)
    assert stats.share_of_limit(1.0, 1.25) == 0.0
    assert math.isnan(stats.share_of_limit(1.1, 1.0))


def test_slower_beyond_noise():
    band = 0.05
    assert not stats.slower_beyond_noise(stats.Spread(0.97, 0.99, 1.01), band)   # inside the band
    assert not stats.slower_beyond_noise(stats.Spread(0.90, 0.94, 0.96), band)   # best round within 5 %
    assert stats.slower_beyond_noise(stats.Spread(0.85, 0.88, 0.94), band)       # every round > 5 % slower


def test_bandwidth_is_weight_bytes_times_steps():
    assert stats.bytes_per_s(500_000_000, 20.0) == 1e10
