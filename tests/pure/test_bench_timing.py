"""How the benchmarks turn step completion times into a step time (issue 28, item 12).

ringleader commits a run-ahead batch's steps within a millisecond of each other; a statistic of
the intervals between completions then measures the commit loop, not a step, and the straggler
benchmark scaled its stalls by that (stalls of ~8 ms: no stall at all)."""

from __future__ import annotations

import pytest

from benchmarks.straggler import StragglerChaos
from benchmarks.throughput import step_seconds


def run_ahead_ends(steps: int, step_s: float, commit_s: float, most: int = 8) -> list[float]:
    """Completion times of ``steps`` steps of ``step_s`` each as ringleader's driver commits
    them: batches of 1, 2, 4, then ``most`` steps per call (``RunAhead``), each batch's steps
    committed ``commit_s`` apart when the batch returns."""
    ends: list[float] = []
    done, batch = 0.0, 1
    while len(ends) < steps:
        size = min(batch, steps - len(ends))
        done += size * step_s
        ends += [done + i * commit_s for i in range(size)]
        batch = min(2 * batch, most)
    return ends


def test_step_time_of_run_ahead_completions_is_the_step_not_the_commit_gap():
    ends = run_ahead_ends(steps=80, step_s=0.1, commit_s=0.0004)
    intervals = sorted(b - a for a, b in zip(ends, ends[1:]))
    assert intervals[len(intervals) // 2] == pytest.approx(0.0004)  # what the median interval measured
    assert step_seconds(ends) == pytest.approx(0.1, rel=0.01)


def test_step_time_of_evenly_spaced_completions_is_their_spacing():
    assert step_seconds([1.0, 1.5, 2.0, 2.5]) == pytest.approx(0.5)


def test_step_time_needs_two_completions():
    with pytest.raises(ValueError, match="at least 2"):
        step_seconds([1.0])


def test_stalls_are_scaled_by_the_step_time_of_bursty_runs():
    # What the straggler benchmark injects, calibrated from a run-ahead run: 20 steps of 100 ms.
    step_s = step_seconds(run_ahead_ends(steps=80, step_s=0.1, commit_s=0.0004))
    entries = StragglerChaos("stall", probability=0.1, stall_steps=20).entries(workers=2, step_s=step_s, shard_s=0.01)
    assert entries["stalls"]["seconds"] == pytest.approx(2.0, rel=0.01)
