import math

import pytest

from train.schedule import GateSchedule, lr_at


def test_gate_is_one_during_warmup_cosine_during_taper_and_exactly_zero_after():
    s = GateSchedule(warmup_steps=10, taper_steps=20)
    assert all(s.gate_at(k) == 1.0 for k in range(10))
    assert s.calibration_step == 10 and s.end == 30
    for k in range(10, 30):
        assert s.gate_at(k) == pytest.approx(0.5 * (1 + math.cos(math.pi * (k - 10) / 20)), abs=1e-15)
    assert s.gate_at(10) == 1.0                       # the cosine starts where warmup ends: no jump
    assert s.gate_at(20) == pytest.approx(0.5)        # half way
    gates = [s.gate_at(k) for k in range(10, 30)]
    assert all(a > b for a, b in zip(gates, gates[1:]))  # strictly decreasing
    assert 0.0 < s.gate_at(29) < 0.01
    for k in (30, 31, 100, 10**6):
        g = s.gate_at(k)
        assert g == 0.0 and type(g) is float          # exactly zero, not merely small
    assert [s.phase(k) for k in (0, 10, 29, 30)] == ["warmup", "taper", "taper", "g=0"]


def test_zero_warmup_starts_the_cosine_at_step_zero():
    s = GateSchedule(0, 4)
    assert [s.gate_at(k) for k in range(5)] == pytest.approx([1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5,
                                                              0.5 - 0.5 * math.cos(math.pi / 4), 0.0])


@pytest.mark.parametrize("warmup, taper", [(10, 0), (10, -3), (-1, 5)])
def test_bad_schedules_are_refused(warmup, taper):
    with pytest.raises(ValueError):
        GateSchedule(warmup, taper)


def test_lr_warms_up_then_decays_to_its_floor():
    lrs = [lr_at(k, 100, 1e-3, warmup=10, final_frac=0.1) for k in range(101)]
    assert lrs[9] == pytest.approx(1e-3)
    assert lrs[0] == pytest.approx(1e-4)
    assert lrs[100] == pytest.approx(1e-4)
    assert max(lrs) == pytest.approx(1e-3)
