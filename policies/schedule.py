"""Learning-rate schedules: the rate is a pure function of the step (and the job's step count),
so a resumed run, a redone step and a rescaled group all use the same rates. Pure: no torch."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

ScheduleName = Literal["constant", "linear", "cosine", "warmup_cosine", "step", "custom"]
BUILTIN_SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine", "warmup_cosine", "step")


@dataclass(frozen=True)
class LearningRateSchedule:
    """The factor on the optimizer's base ``lr`` at each step.

    ``warmup_steps``: the factor ramps linearly from 1/warmup_steps to 1 over the first steps
    (any schedule; ``warmup_cosine`` is ``cosine`` with a warmup). After it: ``constant`` 1;
    ``linear`` from 1 down to ``min_lr_ratio`` at the last step; ``cosine`` / ``warmup_cosine``
    half a cosine from 1 down to ``min_lr_ratio``; ``step`` times ``gamma`` every ``step_size``
    steps; ``custom`` calls ``function(step, num_steps)`` (the user's, which must be a pure
    function of its arguments) for the factor after warmup."""

    name: ScheduleName = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    step_size: int = 100
    gamma: float = 0.1
    function: Callable[[int, int], float] | None = None

    def __post_init__(self) -> None:
        if (self.name == "custom") != (self.function is not None):
            raise ValueError("a custom schedule needs its function, and only a custom one takes one")

    def factor(self, step: int, num_steps: int) -> float:
        """The factor for step ``step`` (0-based) of a job of ``num_steps`` steps. Raises
        ValueError if a custom function returns anything but a finite number >= 0."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        after = step - self.warmup_steps
        if self.name == "constant":
            return 1.0
        if self.function is not None:
            try:
                value = self.function(step, num_steps)
            except Exception as err:  # the user's code: say which field it came from
                raise ValueError(f"field 'schedule.name': the schedule function failed at step {step}: {err!r}") from err
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"field 'schedule.name': the schedule function returned {value!r} for step {step}; "
                    "expected a finite number >= 0"
                )
            return float(value)
        if self.name == "step":
            return self.gamma ** (after // self.step_size)
        span = max(1, num_steps - 1 - self.warmup_steps)
        progress = min(1.0, after / span)
        if self.name == "linear":
            return 1.0 - (1.0 - self.min_lr_ratio) * progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
