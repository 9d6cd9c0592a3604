"""The recovery procedure (``orchestrator/recovery/procedure.py``), the ``Recovering`` state's
work, run directly on the in-process fake group (``tests/helpers/fake_group.py``): the dead
removed, counted and replaced, the evicted leaving for good, the steps a survivor applied
committed and the rest redone, the ``Recovery`` record opened; a worker's own error failing the
job, a network fault retried but not forever, too few workers ending in a checkpoint before
failing, and sharded state lost with its holders rolled back to the run's checkpoint."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import pytest

from jobspec.wire import Progress
from orchestrator.accounting.step_sinks import StepAccounting
from orchestrator.accounting.summary import EVENT_COUNTERS
from orchestrator.checkpoints.coordinator import CheckpointCoordinator
from orchestrator.errors import JobFailed
from orchestrator.group.chaos_control import ChaosControl
from orchestrator.group.membership import JoinerPool
from orchestrator.output.run_dir import RunDirectory
from orchestrator.recovery.procedure import RecoveryProcedure
from orchestrator.recovery.reform import MAX_REFORMS
from orchestrator.steps.pipeline import InFlight, StepOutcome, await_step
from orchestrator.steps.states import CheckpointingBeforeFailure, Recovering, Running, State
from orchestrator.steps.straggler_control import StragglerControl
from orchestrator.store.rendezvous import RendezvousStore
from policies.eviction import Evict
from tests.helpers.fake_group import FakeWorkerGroup, Faults
from tests.helpers.fake_runs import fake_job

SLICE_ENTRIES = 12  # the sharded state's length, as the sliced group below reports it


class SlicedGroup(FakeWorkerGroup):
    """The fake group with sharded optimizer state: each member holds the slice its rank had
    when the group last formed (or loaded a checkpoint), ready for its next step, and says so
    in its progress (``Progress.held``), as the Ray group's workers do."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slices: dict[int, tuple[int, int]] = {}

    def _deal(self) -> None:
        n = self.size
        self.slices = {
            m.worker: (r * SLICE_ENTRIES // n, (r + 1) * SLICE_ENTRIES // n) for r, m in enumerate(self.members)
        }

    def form_group(self, store: RendezvousStore, step: int = -1) -> float:
        transfer_s = super().form_group(store, step)
        self._deal()
        return transfer_s

    def restore(self, root: str, name: str, manifest: dict[str, Any]) -> None:
        super().restore(root, name, manifest)
        self._deal()

    def progress(self, timeout_s: float) -> dict[int, Progress | None]:
        out = super().progress(timeout_s)
        for worker, report in out.items():
            if report is not None and worker in self.slices:
                lo, hi = self.slices[worker]
                out[worker] = replace(report, held=((lo, hi, SLICE_ENTRIES, report.next_step),))
        return out


class Harness:
    """A formed group of 3 fake workers and a ``RecoveryProcedure`` wired as the controller
    wires it (``orchestrator/controller.py``), the accounting and checkpoints with it."""

    def __init__(
        self, tmp_path: Path, *overrides: str, faults: Faults | None = None, replacements: bool = True,
        group_class: type[FakeWorkerGroup] = FakeWorkerGroup,
    ) -> None:
        self.job = fake_job(*overrides)
        self.run = RunDirectory(tmp_path / "run")
        self.group = group_class(self.job, faults, replacements=replacements)
        self.store = RendezvousStore("127.0.0.1", 10.0)
        self.chaos = ChaosControl(self.job.chaos, None, 0, self.run.event)
        self.counters = dict.fromkeys(EVENT_COUNTERS, 0)
        self.checkpoints = CheckpointCoordinator(self.job, self.run, self.counters)
        self.accounting = StepAccounting(
            self.job, self.run, self.group, self.checkpoints, self.counters, time.perf_counter()
        )
        joiners = JoinerPool(self.group, self.job.scaling.max_workers, lambda: self.chaos.dead_nodes)
        self.procedure = RecoveryProcedure(
            self.job, self.run, self.group, self.store, self.chaos, self.checkpoints, self.accounting, joiners
        )
        self.accounting.observers.append(self.procedure.step_completed)
        self.group.start(self.job.scaling.workers)
        self.group.form_group(self.store)
        self.stragglers = StragglerControl(self.job, self.group.workers, self.counters, self.run.event)

    def submit(self, first: int, count: int) -> InFlight:
        """The batch of ``count`` steps from ``first``, handed out as the step pipeline does."""
        plans = [self.stragglers.plan(step) for step in range(first, first + count)]
        workers = tuple(self.group.workers)
        submitted = self.group.submit_steps(first, plans)
        self.group.release_followers()
        return InFlight(first, submitted.reporting, count, submitted.watched, workers)

    def wait(self, batch: InFlight) -> StepOutcome:
        return await_step(self.group, batch, self.job, self.stragglers.evicting)

    def train(self, first: int, count: int) -> None:
        """Run and commit steps ``first`` .. ``first + count - 1`` with nothing going wrong."""
        outcome = self.wait(self.submit(first, count))
        assert not outcome.failed, outcome.errors
        for record in outcome.records:
            self.accounting.commit(record.step, record, complete=True)

    def recover(self, state: Recovering) -> State:
        return self.procedure.recover(state, self.stragglers)

    def events(self, kind: str) -> list[dict[str, Any]]:
        lines = (self.run.path / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == kind]


@pytest.fixture
def harnesses() -> Iterator[list[Harness]]:
    """The harnesses a test makes, their stores closed after it."""
    made: list[Harness] = []
    yield made
    for harness in made:
        harness.store.close()
        harness.run.close()


@pytest.fixture
def make(tmp_path: Path, harnesses: list[Harness]) -> Any:
    def build(*overrides: str, **options: Any) -> Harness:
        harness = Harness(tmp_path / str(len(harnesses)), *overrides, **options)
        harnesses.append(harness)
        return harness

    return build


def died(worker: int) -> StepOutcome:
    return StepOutcome(errors={worker: "ActorDiedError: killed"}, dead={worker})


def test_a_dead_worker_is_removed_counted_and_replaced_and_training_goes_on(make: Any) -> None:
    h = make()
    h.train(0, 2)
    h.group.kill(1)
    assert h.recover(Recovering(died(1))) == Running(2, "3 workers")
    assert 1 not in h.group.workers and h.group.size == 3  # a replacement joined
    assert h.stragglers.workers == h.group.workers
    assert (h.counters["failures"], h.counters["recoveries"], h.counters["joins"]) == (1, 1, 1)
    (failure,) = h.events("failure")
    assert failure["workers"] == [1] and failure["at_step"] == 2
    assert failure["reasons"] == {"1": "ActorDiedError: killed"}
    assert h.events("group_reformed")[0]["workers"] == h.group.workers
    recovery = h.accounting.recoveries.open
    assert recovery is not None and recovery.at_step == 2 and recovery.workers == [1] and recovery.redo_steps == []


def test_detection_counts_from_the_death_chaos_recorded(make: Any) -> None:
    h = make()
    h.chaos.killed_at[1] = time.time() - 5.0
    h.group.kill(1)
    h.recover(Recovering(died(1)))
    recovery = h.accounting.recoveries.open
    assert recovery is not None and 5.0 <= recovery.detect_s < 30.0
    assert h.events("failure")[0]["detect_s"] == recovery.detect_s


def test_a_failure_is_told_to_the_checkpoint_interval_and_abandons_the_pending_checkpoint(make: Any) -> None:
    h = make("checkpoint.every_steps=4")
    h.checkpoints.order(h.group, 4, {})  # to be taken inside a batch that never runs now
    h.group.kill(1)
    h.recover(Recovering(died(1)))
    assert h.checkpoints.pending is None and h.checkpoints.policy.state()["failures"] == 1
    assert "worker(s) [1] left the group" in h.events("checkpoint_abandoned")[0]["reason"]


def test_a_death_mid_batch_commits_the_steps_a_survivor_applied_and_redoes_the_rest(make: Any) -> None:
    h = make(faults=Faults(die_in_step={(1, 1): True}))  # worker 1 dies in step 1, after its all-reduce
    complete: list[int] = []
    h.accounting.observers.append(lambda step, record: complete.append(step))
    batch = h.submit(0, 4)
    outcome = h.wait(batch)
    assert outcome.dead == {1}
    assert h.recover(Recovering(outcome, (batch,))) == Running(2, "3 workers")
    # Held by the survivors: committed without every rank's report, so not told to the observers.
    assert h.accounting.ledger.steps_done == 2 and complete == []
    assert [e["step"] for e in h.events("step")] == [0, 1]
    recovery = h.accounting.recoveries.open
    assert recovery is not None and recovery.at_step == 2 and recovery.redo_steps == [2]
    assert h.counters["steps_redone"] == 1 and h.events("group_reformed")[0]["redo"] == [2]


def test_a_workers_own_error_fails_the_job_naming_the_step_after_committing_what_every_member_applied(
    make: Any
) -> None:
    h = make(faults=Faults(error_in_step={(0, 2): "the batch holds no sample"}))  # the others go on
    batch = h.submit(0, 4)
    outcome = h.wait(batch)
    assert outcome.user_error is not None
    with pytest.raises(JobFailed, match=r"^step 2: ValueError: the batch holds no sample$"):
        h.recover(Recovering(outcome, (batch,)))
    assert h.accounting.ledger.steps_done == 2  # steps 0 and 1, which every member applied


def test_a_network_fault_with_everyone_alive_is_retried_but_not_forever(make: Any) -> None:
    h = make()
    fault = StepOutcome(errors={0: "CollectiveAborted: connection reset"})
    for _ in range(MAX_REFORMS):
        assert h.recover(Recovering(fault)) == Running(0, "3 workers")
    assert h.group.workers == [0, 1, 2] and h.counters["failures"] == h.counters["recoveries"] == 0
    with pytest.raises(JobFailed, match=rf"^step 0 failed {MAX_REFORMS} times in a row"):
        h.recover(Recovering(fault))


def test_a_completed_step_ends_the_failures_in_a_row(make: Any) -> None:
    h = make()
    fault = StepOutcome(errors={0: "CollectiveAborted: connection reset"})
    for _ in range(MAX_REFORMS):
        h.recover(Recovering(fault))
    h.train(0, 1)  # every rank's report in: the procedure's observer resets the count
    for _ in range(MAX_REFORMS):
        assert h.recover(Recovering(fault)) == Running(1, "3 workers")


def test_an_evicted_slow_worker_leaves_for_good_its_slot_retired(make: Any) -> None:
    h = make()
    evict = Evict(2, "slow", {"ratio": 9.5})
    assert h.recover(Recovering(StepOutcome(evict=[evict]))) == Running(0, "2 workers")
    assert h.group.workers == [0, 1] and h.group.capacity == 2
    assert (h.counters["evictions"], h.counters["failures"], h.counters["recoveries"]) == (1, 0, 0)
    (event,) = h.events("evict")
    assert event["worker"] == 2 and event["reason"] == "slow" and event["evidence"] == {"ratio": 9.5}


def test_a_silent_worker_is_a_failure_replaced_in_its_slot(make: Any) -> None:
    h = make()
    why = "silent for 30.0s (stalled or hung)"
    assert h.recover(Recovering(StepOutcome(evict=[Evict(1, "silent", {"why": why})]))) == Running(0, "3 workers")
    assert 1 not in h.group.workers and h.group.size == 3 and h.group.capacity == 3
    assert (h.counters["evictions"], h.counters["failures"]) == (0, 1)
    assert h.events("failure")[0]["reasons"] == {"1": why}


def test_too_few_workers_left_ends_in_a_checkpoint_before_failing(make: Any) -> None:
    h = make("scaling.min_workers=3", "scaling.wait_for_workers_s=0", replacements=False)
    h.train(0, 2)
    h.group.kill(1)
    following = h.recover(Recovering(died(1)))
    assert isinstance(following, CheckpointingBeforeFailure)
    assert dict(following.holders) == {0: 2, 2: 2} and "min_workers" in following.reason


def test_a_death_while_the_group_re_forms_is_counted_and_named_in_the_recovery(make: Any) -> None:
    h = make(faults=Faults(die_joining={2: 0}))
    h.group.kill(1)
    assert h.recover(Recovering(died(1))) == Running(0, "3 workers")
    assert h.counters["failures"] == 2 and h.counters["joins"] == 2
    assert {1, 2}.isdisjoint(h.group.workers)
    assert h.events("reform_failed") and h.events("failure")[-1]["workers"] == [2]
    recovery = h.accounting.recoveries.open
    assert recovery is not None and recovery.workers == [1, 2]


def test_sharded_state_lost_with_no_checkpoint_to_go_back_to_fails_the_job(make: Any) -> None:
    h = make("sharding.group_size=3", group_class=SlicedGroup)
    h.train(0, 2)
    h.group.kill(1)
    lost = r"entries \[4, 8\)\) was lost with worker\(s\) \[1\].*no checkpoint to fall back to"
    with pytest.raises(JobFailed, match=lost):
        h.recover(Recovering(died(1)))


def test_sharded_state_lost_rolls_back_to_the_runs_newest_good_checkpoint_and_redoes_the_steps_after_it(
    make: Any
) -> None:
    h = make("sharding.group_size=3", "checkpoint.every_steps=2", group_class=SlicedGroup)
    h.train(0, 2)
    assert h.checkpoints.save_now(h.group, 2, {}, "periodic")
    h.train(2, 2)
    assert h.checkpoints.save_now(h.group, 4, {}, "periodic")
    next(Path(h.checkpoints.root, "step-00000004").glob("part-*")).unlink()  # the newest no longer verifies
    h.train(4, 1)
    h.group.kill(1)
    assert h.recover(Recovering(died(1))) == Running(2, "3 workers")
    assert "step-00000004" in h.events("checkpoint_skipped")[0]["reason"]
    (lost,) = h.events("state_lost")
    assert lost["checkpoint"] == "step-00000002" and lost["step"] == 2
    assert lost["steps_lost"] == 3 and lost["span"] == [4, 8]
    assert h.accounting.ledger.steps_done == 2 and all(member.next_step == 2 for member in h.group.members)
    assert h.checkpoints.committed_step == 2  # the interval counts from the checkpoint gone back to
    recovery = h.accounting.recoveries.open
    assert recovery is not None and recovery.redo_steps == [2, 3, 4] and h.counters["steps_redone"] == 3


def test_steps_held_after_a_failure_are_committed_up_to_the_state_kept(make: Any) -> None:
    h = make()
    batch = h.submit(0, 3)
    outcome = h.wait(batch)
    h.procedure.commit_held((batch,), outcome.records, 2)
    assert h.accounting.ledger.steps_done == 2 and [e["step"] for e in h.events("step")] == [0, 1]
