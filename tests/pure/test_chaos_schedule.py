"""The injected slowness and stalls of one worker (`workers/runtime/chaos.py`) and the read ahead of
its first batch (`workers/data/prefetch.py`): pure timing, no Ray."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from jobspec.chaos import ChaosConfig
from workers.runtime.chaos import ChaosSchedule


def _schedule(chaos: dict, worker: int = 0) -> ChaosSchedule:
    return ChaosSchedule.for_worker(ChaosConfig.model_validate(chaos), worker, threading.Event())


def test_a_slowdown_multiplies_the_compute_measured_before_it_began():
    schedule = _schedule({"slow": [{"worker": 0, "factor": 4, "from_step": 5}]})
    for step in range(5):
        schedule.record(step, 0.010 * 2, shards=2)
    # Slowed, the worker's compute looks slower (contention, few shards per pass, lost races):
    # none of that may feed the sleep, or a 4x worker ends up far slower than 4x.
    for step in range(5, 30):
        schedule.record(step, 0.050, shards=1)
    assert schedule.base_shard_s() == pytest.approx(0.010)
    slept = schedule.slow_down(30, shards=1, interrupted=lambda: False)
    assert slept == pytest.approx(3 * 0.010, abs=0.008)
    # After the spell the base follows the worker's compute again.
    late = _schedule({"slow": [{"worker": 0, "factor": 4, "from_step": 5, "to_step": 10}]})
    late.record(0, 0.010, 1)
    late.record(12, 0.020, 1)
    assert 0.010 < late.base_shard_s() < 0.020


def test_a_slowdown_from_the_first_step_takes_its_base_from_its_first_steps():
    schedule = _schedule({"slow": [{"worker": 0, "factor": 4}]})
    assert schedule.slow_down(0, 1, lambda: False) == 0.0  # nothing measured yet
    for step, shard_s in enumerate([0.200, 0.010, 0.012]):  # step 0 warms up
        schedule.record(step, shard_s, 1)
    for step in range(3, 20):
        schedule.record(step, 0.080, 1)
    assert schedule.base_shard_s() == pytest.approx(0.012)


def test_random_stalls_are_drawn_from_seed_worker_and_step_alone():
    chaos = {"stalls": {"probability": 0.05, "seconds": 2.0, "seed": 7}}
    drawn = {w: [s for s in range(4000) if _schedule(chaos, w).stall_s(s, "fetch")] for w in (0, 1)}
    again = [s for s in range(4000) if _schedule(chaos, 0).stall_s(s, "fetch")]
    assert drawn[0] == again and drawn[0] != drawn[1]
    assert 0.035 < len(drawn[0]) / 4000 < 0.065
    assert all(_schedule(chaos, 0).stall_s(s, "fetch") == 2.0 for s in drawn[0][:5])
    assert not any(_schedule(chaos, 0).stall_s(s, "compute") for s in drawn[0])  # only where asked
    other_seed = {"stalls": {**chaos["stalls"], "seed": 8}}
    assert drawn[0] != [s for s in range(4000) if _schedule(other_seed, 0).stall_s(s, "fetch")]


def test_a_planned_stall_holds_up_its_point_and_ends_early_only_on_an_abort():
    schedule = _schedule({"stall": [{"worker": 0, "at_step": 3, "seconds": 5}, {"worker": 0, "at_step": 4, "seconds": 0.05, "during": "compute"}]})
    assert schedule.stall_s(3, "fetch") == 5 and schedule.stall_s(3, "compute") == 0
    assert schedule.stall_s(4, "compute") == 0.05 and schedule.stall(2) == 0.0
    assert schedule.stall(4) == pytest.approx(0.05, abs=0.03)  # all points: the compute one
    threading.Timer(0.1, schedule.abort_flag.set).start()
    started = time.perf_counter()
    assert schedule.stall(3, "fetch") < 1 and time.perf_counter() - started < 1


def test_a_batch_read_ahead_is_waited_for_watching_and_taken_once_by_its_indices():
    from workers.data.prefetch import BatchPrefetch

    release = threading.Event()
    prefetch = BatchPrefetch(lambda indices: indices * 10)
    prefetch.start(np.arange(3), before=lambda: release.wait(5))
    asked = []
    assert not prefetch.wait(lambda: asked.append(1) or len(asked) >= 2)  # given up, read goes on
    assert not prefetch.ready() and prefetch.take(np.arange(3)) is None
    release.set()
    assert prefetch.wait(lambda: False) and prefetch.ready()
    assert prefetch.take(np.arange(4)) is None  # other indices: read them yourself
    assert list(prefetch.take(np.arange(3))) == [0, 10, 20]
    assert prefetch.take(np.arange(3)) is None  # once
    prefetch.start(np.arange(2), before=lambda: 1 / 0)
    assert prefetch.wait(lambda: False)
    with pytest.raises(ZeroDivisionError):
        prefetch.take(np.arange(2))


def test_a_slowdown_with_a_given_compute_per_shard_sleeps_by_it():
    schedule = _schedule({"slow": [{"worker": 0, "factor": 3, "from_step": 2, "shard_s": 0.004}]})
    schedule.record(0, 0.050, 1)
    assert schedule.base_shard_s(2) == 0.004 and schedule.base_shard_s(1) == pytest.approx(0.050)
    assert schedule.slow_down(2, shards=2, interrupted=lambda: False) == pytest.approx(2 * 0.004 * 2, abs=0.008)


def test_a_read_ahead_is_taken_by_a_start_of_its_indices_after_the_starts_own_before():
    """The next step's batch read ahead is taken (read once) by a start of exactly its indices,
    whose ``before`` (an injected stall) still runs first; a start of other indices drops it."""
    from workers.data.prefetch import BatchPrefetch

    reads = []
    prefetch = BatchPrefetch(lambda indices: reads.append(indices.tolist()) or indices * 10)
    prefetch.start(np.arange(2))
    prefetch.read_ahead(np.arange(2, 4))
    assert prefetch.wait(lambda: False) and list(prefetch.take(np.arange(2))) == [0, 10]
    stalled = []
    prefetch.start(np.arange(2, 4), before=lambda: stalled.append(True))
    assert prefetch.wait(lambda: False) and list(prefetch.take(np.arange(2, 4))) == [20, 30] and stalled == [True]
    prefetch.read_ahead(np.arange(4, 6))
    prefetch.start(np.arange(6, 8))  # the plan changed: other indices
    assert prefetch.wait(lambda: False) and list(prefetch.take(np.arange(6, 8))) == [60, 70]
    assert sorted(reads[:2]) == [[0, 1], [2, 3]] and reads.count([2, 3]) == 1 and [6, 7] in reads  # read once


def test_a_read_ahead_does_not_queue_behind_a_stalled_read():
    """The current read stalls (its ``before``); the next step's batch, read ahead, is in
    meanwhile, and a start of its indices takes it without waiting for the stalled one."""
    from workers.data.prefetch import BatchPrefetch

    release = threading.Event()
    prefetch = BatchPrefetch(lambda indices: indices * 10)
    prefetch.start(np.arange(2), before=lambda: release.wait(10))
    prefetch.read_ahead(np.arange(2, 4))
    prefetch.start(np.arange(2, 4))  # the stalled step was given up: the next one starts
    started = time.perf_counter()
    assert prefetch.wait(lambda: False) and list(prefetch.take(np.arange(2, 4))) == [20, 30]
    assert time.perf_counter() - started < 5
    release.set()


def test_a_stuck_read_ahead_that_was_taken_holds_one_fetch_thread_not_two():
    """Three steps in a row take a read ahead that never ends and give up on it: each holds one
    of the FETCH_THREADS (its read), so a fourth step's read still finds a thread."""
    from workers.data.prefetch import FETCH_THREADS, BatchPrefetch

    stuck = threading.Event()
    prefetch = BatchPrefetch(lambda indices: stuck.wait(30) if indices[0] >= 100 else indices * 10)
    for step in range(FETCH_THREADS - 1):
        prefetch.read_ahead(np.array([100 + step]))
        prefetch.start(np.array([100 + step]))
        assert not prefetch.wait(lambda: True)  # given up: the read goes on
    prefetch.start(np.arange(2))
    started = time.perf_counter()
    assert prefetch.wait(lambda: time.perf_counter() - started > 5) and list(prefetch.take(np.arange(2))) == [0, 10]
    stuck.set()
