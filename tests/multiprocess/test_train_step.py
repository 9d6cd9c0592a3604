"""``StepTrainer`` (``workers/train_step.py``): one training step, run by a real ``TrainWorker``
(no Ray) in a gloo group of one on a local ``TCPStore``. A step runs only once the worker has
joined and only as the replica's next step; it applies exactly one optimizer step with the
scheduled learning rate and reports what it counted; a gradient that is not finite stops the
job at that step and leaves the replica as it was."""

from __future__ import annotations

import pytest
import torch

from jobspec.wire import JoinRequest
from orchestrator.job.reading import load_job
from policies.work_stealing import StepPlan
from tests.helpers.ranks import free_port, tcp_store
from workers.actor import TrainWorker
from workers.train_step import StepTrainer

SHARDS = 4
ALL_MINE = StepPlan((tuple(range(SHARDS)),), steal=False, speculate=False)


def _worker(*overrides: str) -> TrainWorker:
    job = load_job(None, ["steps=3", "eval=null", f"shards={SHARDS}", "batch_size=16", "scaling.workers=1", *overrides])
    return TrainWorker(job, device=torch.device("cpu"))


@pytest.fixture
def joined():
    """A worker that joined generation 1 of a group of one (the store is kept alive beside it)."""
    port = free_port()
    store = tcp_store(0, 1, port)
    workers: list[TrainWorker] = []

    def join(*overrides: str) -> TrainWorker:
        worker = _worker(*overrides)
        worker.join_group(JoinRequest("127.0.0.1", port, f"gen{len(workers) + 1}/", 1, 0, ("node",), 30.0))
        workers.append(worker)
        return worker

    yield join
    for worker in workers:
        worker.leave_group()
    del store


def test_a_step_before_the_join_is_refused():
    worker = _worker()
    assert isinstance(worker.trainer, StepTrainer)
    with pytest.raises(RuntimeError, match="train_step called before join_group"):
        worker.train_step(0, ALL_MINE)
    assert worker.next_step == 0


def test_only_the_replicas_next_step_runs_and_it_applies_one_optimizer_step(joined):
    worker = joined("schedule={name: step, step_size: 1, gamma: 0.5}")
    before = worker.flat.values.clone()
    with pytest.raises(RuntimeError, match="asked for step 1, but this replica's next step is 0"):
        worker.train_step(1, ALL_MINE)  # applying a step out of order would corrupt the replica
    assert torch.equal(worker.flat.values, before)
    first = worker.train_step(0, ALL_MINE)
    second = worker.train_step(1, ALL_MINE)
    assert worker.next_step == 2 and not torch.equal(worker.flat.values, before)
    assert (first.step, first.shards_counted, first.skipped) == (0, SHARDS, False)
    assert second.lr == pytest.approx(first.lr * 0.5)  # the schedule's factor at step 1
    assert [r.step for r in worker.kept_reports(0, 2)] == [0, 1]


def test_a_gradient_that_is_not_finite_stops_at_its_step_and_changes_nothing(joined):
    worker = joined("loss=tests.helpers.losses:exploding_loss")
    before = worker.flat.values.clone()
    with pytest.raises(FloatingPointError, match="step 0: the reduced gradient is not finite"):
        worker.train_step(0, ALL_MINE)
    assert worker.next_step == 0 and torch.equal(worker.flat.values, before)
