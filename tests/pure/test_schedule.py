"""Learning-rate schedules (pure)."""

from __future__ import annotations

import math

import pytest

from policies.schedule import LearningRateSchedule


def test_constant_with_warmup():
    s = LearningRateSchedule("constant", warmup_steps=4)
    assert [s.factor(t, 100) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_warmup_cosine_ends_at_the_minimum():
    s = LearningRateSchedule("warmup_cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert s.factor(9, 110) == 1.0 and s.factor(10, 110) == 1.0
    assert math.isclose(s.factor(109, 110), 0.1)
    assert math.isclose(s.factor(60, 110), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 50 / 99)))
    values = [s.factor(t, 110) for t in range(10, 110)]
    assert values == sorted(values, reverse=True)


def test_linear_and_step():
    assert math.isclose(LearningRateSchedule("linear").factor(99, 100), 0.0)
    assert math.isclose(LearningRateSchedule("linear", min_lr_ratio=0.5).factor(50, 101), 0.75)
    s = LearningRateSchedule("step", step_size=10, gamma=0.5)
    assert [s.factor(t, 100) for t in (0, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]


def test_negative_step_is_refused():
    with pytest.raises(ValueError, match="step"):
        LearningRateSchedule().factor(-1, 10)
