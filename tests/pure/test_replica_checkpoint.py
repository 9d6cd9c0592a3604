"""``CheckpointWriter``: an attempt the driver abandons before its snapshot (``cancel``) ends every
wait for it at once, running or still queued on the actor's one ``io`` thread, so the next
attempt's wait is not held up behind them; its late snapshot is not taken; a part already
being written is left to finish. No Ray."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from jobspec.job import JobConfig
from jobspec.wire import SnapshotRequest
from tests.helpers.replicas import FakeReplica
from workers.replica_checkpoint import CheckpointWriter
from workers.runtime.chaos import ChaosSchedule

#: What a wait is allowed: far more than settling it takes, far less than the job's
#: ``timeouts.checkpoint_s`` (which a wait for a snapshot that never comes used to run to).
WAIT_S = 5.0
NAME = "step-00000002"


def _writer() -> CheckpointWriter:
    return CheckpointWriter(ChaosSchedule.for_worker(JobConfig().chaos, 0, threading.Event()), lambda: None)


def _request(root, tag: str, step: int = 2) -> SnapshotRequest:
    return SnapshotRequest(step, str(root), f"step-{step:08d}", tag, 0, 1)


def test_cancelled_attempts_end_their_waits_running_and_queued_and_the_next_is_written(tmp_path):
    writer, replica = _writer(), FakeReplica("RAdam", {"lr": 0.01})
    replica.train(2)
    # The actor's io thread: two abandoned attempts' waits (their batches failed before the
    # step), then the next attempt's.
    io = ThreadPoolExecutor(1)
    stale = [io.submit(writer.written, NAME, tag, WAIT_S) for tag in ("d-a1", "d-a2")]
    fresh = io.submit(writer.written, NAME, "d-a3", WAIT_S)
    writer.cancel(NAME, "d-a1")
    writer.cancel(NAME, "d-a2")
    writer.snapshot(_request(tmp_path, "d-a3"), replica, {}, 0)
    for tag, wait in zip(("d-a1", "d-a2"), stale):
        with pytest.raises(RuntimeError, match=f"{NAME}/{tag} was abandoned by the driver"):
            wait.result(timeout=WAIT_S / 2)
    assert fresh.result(timeout=WAIT_S / 2).files
    io.shutdown()


def test_a_cancelled_attempt_takes_no_late_snapshot_and_its_later_wait_ends_at_once(tmp_path):
    writer, replica = _writer(), FakeReplica("RAdam", {"lr": 0.01})
    replica.train(2)
    writer.cancel(NAME, "d-a1")
    with pytest.raises(RuntimeError, match="abandoned by the driver"):
        writer.snapshot(_request(tmp_path, "d-a1"), replica, {}, 0)
    with pytest.raises(RuntimeError, match="abandoned by the driver"):
        writer.written(NAME, "d-a1", WAIT_S)
    assert not (tmp_path / NAME).exists()


def test_a_cancel_leaves_a_part_being_written_to_finish(tmp_path):
    writer, replica = _writer(), FakeReplica("RAdam", {"lr": 0.01})
    replica.train(2)
    writer.snapshot(_request(tmp_path, "d-a1"), replica, {}, 0)
    writer.cancel(NAME, "d-a1")
    assert writer.written(NAME, "d-a1", WAIT_S).files
