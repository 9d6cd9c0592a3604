"""The checkpoint-interval policy: fixed intervals, Young/Daly, clamping, state, validation."""

from __future__ import annotations

import json
import math

import pytest

from policies.checkpoint_interval import DEFAULT_STEPS, CheckpointDecision, CheckpointInterval


def measured(policy: CheckpointInterval, *, step_s: float, cost_s: float) -> CheckpointInterval:
    policy.observe_step(step_s)
    policy.observe_checkpoint(cost_s)
    return policy


def test_fixed_interval_ignores_measurements():
    policy = measured(CheckpointInterval(25), step_s=0.1, cost_s=0.5)
    policy.observe_failure()
    assert policy.decide() == CheckpointDecision(25, "fixed")
    assert not policy.due(24)
    assert policy.due(25) and policy.due(26)


def test_auto_uses_default_until_measured():
    policy = CheckpointInterval(None)
    decision = policy.decide()
    assert decision.every_steps == DEFAULT_STEPS
    assert "step time and checkpoint cost" in decision.reason
    policy.observe_step(0.1)
    assert "checkpoint cost" in policy.decide().reason
    assert CheckpointInterval(None, max_steps=10).decide().every_steps == 10


def test_young_daly_value():
    # C = 0.5 s, M = prior 3600 s -> sqrt(2 * 0.5 * 3600) = 60 s; at 0.1 s per step: 600 steps.
    policy = measured(CheckpointInterval(None), step_s=0.1, cost_s=0.5)
    decision = policy.decide()
    assert decision.every_steps == 600
    assert decision.reason.startswith("young-daly:")
    assert "cost 0.5s" in decision.reason and "mtbf 3600s" in decision.reason and "60s" in decision.reason
    assert not policy.due(599) and policy.due(600)


def test_mtbf_estimate_includes_elapsed_time():
    policy = measured(CheckpointInterval(None), step_s=0.1, cost_s=0.5)
    policy.observe_elapsed(3600.0)
    policy.observe_elapsed(10_800.0)  # set, not added: M = (10800 + 3600) / 1
    assert policy.mtbf_s() == 14_400.0
    assert policy.decide().every_steps == round(math.sqrt(2 * 0.5 * 14_400) / 0.1)


def test_more_failures_shorten_the_interval():
    policy = measured(CheckpointInterval(None), step_s=0.1, cost_s=0.5)
    policy.observe_elapsed(3600.0)
    intervals = []
    for _ in range(4):
        intervals.append(policy.decide().every_steps)
        policy.observe_failure()
    assert intervals == sorted(intervals, reverse=True) and len(set(intervals)) == 4
    assert policy.mtbf_s() == pytest.approx(7200.0 / 5)


def test_ewma_smoothing():
    policy = CheckpointInterval(None)
    policy.observe_step(1.0)
    policy.observe_step(2.0)  # 0.2 * 2 + 0.8 * 1
    policy.observe_checkpoint(1.0)
    policy.observe_checkpoint(2.0)  # 0.5 * 2 + 0.5 * 1
    state = policy.state()
    assert state["step_s"] == pytest.approx(1.2)
    assert state["cost_s"] == pytest.approx(1.5)


def test_clamping_to_min_and_max():
    tiny = measured(CheckpointInterval(None, min_steps=5), step_s=100.0, cost_s=0.01)
    assert tiny.decide().every_steps == 5
    assert "clamped" in tiny.decide().reason
    huge = measured(CheckpointInterval(None, max_steps=1000), step_s=0.001, cost_s=10.0)
    assert huge.decide().every_steps == 1000
    free = measured(CheckpointInterval(None), step_s=0.1, cost_s=0.0)
    assert free.decide().every_steps == 1


def test_state_restore_round_trip():
    policy = measured(CheckpointInterval(None), step_s=0.1, cost_s=0.5)
    policy.observe_failure()
    policy.observe_elapsed(123.5)
    state = json.loads(json.dumps(policy.state()))
    fresh = CheckpointInterval(None)
    fresh.restore(state)
    assert fresh.state() == policy.state()
    assert fresh.decide() == policy.decide()
    empty = CheckpointInterval(None)
    empty.restore(CheckpointInterval(None).state())
    assert empty.decide().every_steps == DEFAULT_STEPS


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"every_steps": 0}, "every_steps"),
        ({"every_steps": True}, "every_steps"),
        ({"every_steps": 2.5}, "every_steps"),
        ({"every_steps": None, "mtbf_prior_s": 0.0}, "mtbf_prior_s"),
        ({"every_steps": None, "mtbf_prior_s": math.inf}, "mtbf_prior_s"),
        ({"every_steps": None, "min_steps": 0}, "min_steps"),
        ({"every_steps": None, "min_steps": 10, "max_steps": 5}, "max_steps"),
    ],
)
def test_bad_constructor_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CheckpointInterval(**kwargs)


def test_bad_observations_and_state():
    policy = CheckpointInterval(None)
    for call, arg, name in [
        (policy.observe_step, 0.0, "step_s"),
        (policy.observe_step, math.nan, "step_s"),
        (policy.observe_checkpoint, -1.0, "cost_s"),
        (policy.observe_elapsed, -1.0, "elapsed_s"),
        (policy.due, -1, "steps_since_last"),
    ]:
        with pytest.raises(ValueError, match=name):
            call(arg)
    with pytest.raises(ValueError, match="keys"):
        policy.restore({"step_s": 0.1})
    with pytest.raises(ValueError, match="failures"):
        policy.restore({"step_s": None, "cost_s": None, "failures": -1, "elapsed_s": 0.0})
    assert policy.state() == CheckpointInterval(None).state()  # failed calls changed nothing
