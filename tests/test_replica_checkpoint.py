"""``CheckpointWriter``: a checkpoint attempt whose snapshot never comes (its batch failed
before the step) is settled as superseded by the next attempt's snapshot, so the actor's one
``io`` thread, waiting for the old attempt, is free for the new one's wait. No Ray."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from jobspec.job import JobConfig
from jobspec.wire import SnapshotRequest
from tests.helpers.replicas import FakeReplica
from workers.chaos import ChaosSchedule
from workers.replica_checkpoint import CheckpointWriter

#: What the old attempt's wait is allowed: far more than settling it takes, far less than the
#: job's ``timeouts.checkpoint_s`` (which a wait for a snapshot that never comes used to run to).
WAIT_S = 5.0


def _writer() -> CheckpointWriter:
    return CheckpointWriter(ChaosSchedule.for_worker(JobConfig().chaos, 0, threading.Event()), lambda: None)


def test_a_new_attempt_settles_the_wait_for_one_whose_snapshot_never_came(tmp_path):
    writer, replica = _writer(), FakeReplica("RAdam", {"lr": 0.01})
    replica.train(2)
    # The actor's io thread: the old attempt's wait first, the new one's queued behind it.
    io = ThreadPoolExecutor(1)
    stale = io.submit(writer.written, "step-00000002", "d-a1", WAIT_S)
    fresh = io.submit(writer.written, "step-00000002", "d-a2", WAIT_S)
    writer.snapshot(SnapshotRequest(2, str(tmp_path), "step-00000002", "d-a2", 0, 1), replica, {}, 0)
    with pytest.raises(RuntimeError, match="d-a1 was superseded by step-00000002/d-a2"):
        stale.result(timeout=2 * WAIT_S)
    assert fresh.result(timeout=2 * WAIT_S).files
    io.shutdown()


def test_a_new_attempt_leaves_an_older_one_being_written_to_finish(tmp_path):
    writer, replica = _writer(), FakeReplica("RAdam", {"lr": 0.01})
    replica.train(2)
    writer.snapshot(SnapshotRequest(2, str(tmp_path), "step-00000002", "d-a1", 0, 1), replica, {}, 0)
    replica.train(2)
    writer.snapshot(SnapshotRequest(4, str(tmp_path), "step-00000004", "d-a2", 0, 1), replica, {}, 0)
    assert writer.written("step-00000002", "d-a1", WAIT_S).files
    assert writer.written("step-00000004", "d-a2", WAIT_S).files
