"""A worker copying its part of a checkpoint is busy, not silent: the driver's silence judgement
excuses it (for as long as a checkpoint may take), and a generic optimizer whose state is slow
to serialize (RAdam, a user's Lion) checkpoints every few steps under a short ``silent_s``
without a worker evicted or a checkpoint abandoned, and resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobspec.wire import Phase, Progress
from policies.eviction import silent_workers
from tests.helpers.jobs import assert_same_params, jsonl, params, run
from workers.checkpoint_manifest import verify_checkpoint
from workers.checkpoint_storage import CheckpointStorage


def _progress(step: int, phase: str, since_s: float = 6.0, since_snapshot_s: float | None = None) -> Progress:
    return Progress(step=step, phase=Phase(phase), since_s=since_s, next_step=step + 1, since_snapshot_s=since_snapshot_s)


def test_a_worker_copying_a_snapshot_is_busy_until_a_checkpoint_may_take_no_longer():
    waiting = {1: _progress(8, "reduce"), 2: _progress(8, "idle")}  # in step 8 for 6 s, silent_s 5
    # Worker 0 copies its part of the checkpoint after step 7 (queued before step 8).
    assert silent_workers({**waiting, 0: _progress(7, "snapshot", 4.0)}, 5.0, 600.0) == []
    (stuck,) = silent_workers({**waiting, 0: _progress(7, "snapshot", 700.0)}, 5.0, 600.0)
    assert stuck.worker == 0 and stuck.reason == "silent"
    assert stuck.evidence["why"] == "copying a checkpoint snapshot for 700s, longer than a checkpoint may take (600s)"
    # Done copying 1 s ago, in step 8 now: its peers' wait began during the snapshot.
    assert silent_workers({**waiting, 0: _progress(8, "compute", 1.0, since_snapshot_s=1.0)}, 5.0, 600.0) == []
    # silent_s after the snapshot it is held responsible again; so is one that snapshotted long ago.
    for late in (_progress(8, "compute", 5.0, since_snapshot_s=5.0), _progress(7, "done", 9.0, since_snapshot_s=90.0)):
        (evict,) = silent_workers({**waiting, 0: late}, 5.0, 600.0)
        assert evict.worker == 0 and evict.evidence["why"] == "silent for 5.0s (stalled or hung)"
    # Not answering is silence, snapshot or not.
    assert [e.worker for e in silent_workers({**waiting, 0: None}, 5.0, 600.0)] == [0]


# The digits model (hidden 32) whose workers' torch.save writes 4000 bytes of floating-point data
# a second: RAdam's whole state (28 KB) then takes 7 s to serialize, a part of a 2-worker
# checkpoint (21 KB) 5 s in the background; silent_s is 2 s.
SLOW_MODEL = "model={factory: 'tests.helpers.slow_save:make_model_slow_to_save', kwargs: {hidden: 32, bytes_per_s: 4000}}"
OPTIMIZERS = [
    "optimizer={name: RAdam, kwargs: {lr: 0.01, weight_decay: 0.1}}",
    "optimizer={name: 'tests.helpers.optimizers:Lion', kwargs: {lr: 0.001, weight_decay: 0.1}}",
]


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=["RAdam", "Lion"])
def test_a_generic_optimizer_checkpoints_under_a_short_silent_s_and_resumes_exactly(tmp_path, optimizer):
    job = (SLOW_MODEL, optimizer, "stragglers.silent_s=2")
    first = run(tmp_path, "split", "steps=12", "scaling.workers=2", "checkpoint.every_steps=4", *job)
    second = run(tmp_path, "split", "steps=20", "scaling.workers=3", "checkpoint.every_steps=4", *job)
    events = jsonl(first.run_dir / "events.jsonl")  # both runs append to the run directory's log
    trouble = [e for e in events if e["event"] in ("evict", "failure", "checkpoint_abandoned")]
    assert trouble == [] and first.summary["events"]["failures"] == second.summary["events"]["failures"] == 0
    # One due while the last is still being written (5 s here) is skipped: the others are all there.
    taken = [e["step"] for e in events if e["event"] == "checkpoint"]
    assert {4, 12, 20} <= set(taken) and taken == sorted(set(taken))
    assert [e["checkpoint"] for e in events if e["event"] == "resume"] == ["step-00000012"]
    for ran, step in ((first, 12), (second, 20)):  # the checkpoint each ended with verifies
        verify_checkpoint(CheckpointStorage(ran.summary["checkpoints"]["root"]), f"step-{step:08d}")
    # The momentum is sliced across the parts, like the parameters.
    parts = sorted((Path(second.summary["checkpoints"]["root"]) / "step-00000020").glob("part-*.pt"))
    slices = [torch.load(p, weights_only=True)["slices"]["optim/state/exp_avg"].numel() for p in parts]
    assert len(slices) == 3 and all(n > 0 for n in slices)
    reference = run(tmp_path, "one", "steps=20", "scaling.workers=1", "checkpoint.every_steps=0", *job)
    assert_same_params(params(second.run_dir), params(reference.run_dir), f"{optimizer}: checkpointed, resumed on 3")
