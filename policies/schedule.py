"""Learning-rate schedules: the rate is a pure function of the step (and the job's step count),
so a resumed run, a redone step and a rescaled group all use the same rates. Pure: no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

ScheduleName = Literal["constant", "linear", "cosine", "warmup_cosine", "step"]


@dataclass(frozen=True)
class LearningRateSchedule:
    """The factor on the optimizer's base ``lr`` at each step.

    ``warmup_steps``: the factor ramps linearly from 1/warmup_steps to 1 over the first steps
    (any schedule; ``warmup_cosine`` is ``cosine`` with a warmup). After it: ``constant`` 1;
    ``linear`` from 1 down to ``min_lr_ratio`` at the last step; ``cosine`` / ``warmup_cosine``
    half a cosine from 1 down to ``min_lr_ratio``; ``step`` times ``gamma`` every ``step_size``
    steps."""

    name: ScheduleName = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    step_size: int = 100
    gamma: float = 0.1

    def factor(self, step: int, num_steps: int) -> float:
        """The factor for step ``step`` (0-based) of a job of ``num_steps`` steps."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        after = step - self.warmup_steps
        if self.name == "constant":
            return 1.0
        if self.name == "step":
            return self.gamma ** (after // self.step_size)
        span = max(1, num_steps - 1 - self.warmup_steps)
        progress = min(1.0, after / span)
        if self.name == "linear":
            return 1.0 - (1.0 - self.min_lr_ratio) * progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
