"""RunAhead: batches grow while the job is quiet, fall back to one step, stop at boundaries."""

from __future__ import annotations

import pytest

from policies.run_ahead import MAX_STEPS_PER_CALL, RunAhead


def test_the_batch_doubles_while_quiet_and_falls_back_to_one_step():
    ahead = RunAhead(8)
    sizes = []
    for quiet in [True, True, True, True, True, False, True]:
        sizes.append(ahead.size)
        ahead.observe(quiet)
    assert sizes == [1, 2, 4, 8, 8, 8, 1]
    ahead.restart()
    assert ahead.size == 1


def test_a_batch_stops_in_front_of_a_boundary_and_at_the_end():
    ahead = RunAhead(8, size=8)
    assert ahead.batch(10, 100, lambda step: False) == 8
    assert ahead.batch(10, 100, lambda step: step == 13) == 3  # 10, 11, 12: the driver acts before 13
    assert ahead.batch(10, 100, lambda step: step == 10) == 8  # the first step's boundary is before it
    assert ahead.batch(95, 100, lambda step: False) == 5
    assert RunAhead(1, size=1).batch(0, 100, lambda step: False) == 1


@pytest.mark.parametrize("bad", [0, MAX_STEPS_PER_CALL + 1])
def test_the_most_steps_per_call_is_bounded(bad):
    with pytest.raises(ValueError, match="max_steps"):
        RunAhead(bad)
