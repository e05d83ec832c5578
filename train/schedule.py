"""The TaperNorm gate schedule and the learning-rate schedule.

    step:   0 ........ W ............... W + T ............ N
    gate:   1 (warmup)  cosine 1 -> 0     0 (continue at g = 0)
                        ^ calibrate c and start gamma_tilde from gamma here

gate_at(step) is the gate used by the update of `step` (0-based). The cosine is
0.5 * (1 + cos(pi * (step - W) / T)) for W <= step < W + T and exactly 0.0 from
W + T on (not a float that happens to be close to 0): a finished model is the
fixed linear map and exports without its normalized branch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GateSchedule:
    warmup_steps: int   # W: steps at g = 1 before calibration
    taper_steps: int    # T: steps of the cosine from 1 to 0

    def __post_init__(self):
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps = {self.warmup_steps}; expected >= 0")
        if self.taper_steps <= 0:
            raise ValueError(f"taper_steps = {self.taper_steps}; expected > 0")

    @property
    def calibration_step(self) -> int:
        """Calibration runs before the update of this step."""
        return self.warmup_steps

    @property
    def end(self) -> int:
        """First step at g = 0 exactly."""
        return self.warmup_steps + self.taper_steps

    def gate_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return 1.0
        if step >= self.end:
            return 0.0
        t = (step - self.warmup_steps) / self.taper_steps
        return 0.5 * (1.0 + math.cos(math.pi * t))

    def phase(self, step: int) -> str:
        return "warmup" if step < self.warmup_steps else "taper" if step < self.end else "g=0"


def lr_at(step: int, total_steps: int, peak: float, warmup: int = 50, final_frac: float = 0.1) -> float:
    """Linear warmup to `peak`, then cosine down to final_frac * peak at total_steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return peak * (final_frac + (1.0 - final_frac) * 0.5 * (1.0 + math.cos(math.pi * t)))
