"""The job controller: owns a job from start to summary as a loop over states
(``orchestrator/steps/states.py``; docs/architecture.md, "The controller").

Each state's handler does its work and returns the next state; ``_step`` runs one handler and
returns ``(previous, next)``; every change of kind is an event in ``events.jsonl``. The
controller talks to workers only through a ``WorkerGroup`` (``orchestrator/group/interface.py``): Ray
actors in a job, an in-process fake (``tests/helpers/fake_group.py``) in ``tests/pure/test_recovery.py``.
"""

from __future__ import annotations

import time
from typing import Any

from jobspec.job import JobConfig
from jobspec.wire import SnapshotOrder
from orchestrator.accounting.step_sinks import StepAccounting
from orchestrator.accounting.summary import EVENT_COUNTERS, JobResult
from orchestrator.checkpoints.coordinator import CheckpointCoordinator
from orchestrator.checkpoints.lease import NamespaceLease
from orchestrator.checkpoints.resume_point import ResumePoint
from orchestrator.errors import JobFailed
from orchestrator.group.chaos_control import ChaosControl, ChaosError
from orchestrator.group.interface import CallFailed, WorkerGroup, WorkerGroupError
from orchestrator.group.membership import JoinerPool
from orchestrator.output.control_meter import ControlPlaneMeter
from orchestrator.output.run_dir import RunDirectory
from orchestrator.recovery.procedure import RecoveryProcedure
from orchestrator.recovery.reform import PROBE_S, sharding_of
from orchestrator.steps.pipeline import StepOutcome, StepPipeline, await_step
from orchestrator.steps.states import (
    CheckpointingBeforeFailure,
    Failed,
    Finished,
    Growing,
    Recovering,
    Running,
    Starting,
    State,
    Stopped,
    check_transition,
    is_terminal,
)
from orchestrator.steps.straggler_control import StragglerControl
from orchestrator.store.rendezvous import RendezvousStore
from policies.elasticity import pick_root
from policies.run_ahead import RunAhead
from policies.work_stealing import StepPlan
from workers.step.claims import open_step


class JobController:
    """Runs one job on ``group`` (not started yet), meeting its workers at ``store``: start,
    train, evaluate, save, summarise (see the module doc). ``launched``: ``perf_counter()`` at
    launch, for start-up milestones; ``resume``: the checkpoint to go on from; ``lease``: of
    the checkpoint namespace, held by the caller (``hold_namespace``). A committed
    step is ``accounting``'s to fan out (``orchestrator/accounting/step_sinks.py``), a recovery
    ``recovery``'s to carry out (``orchestrator/recovery/procedure.py``). It answers the step
    pipeline's questions about each batch (``BatchHooks``)."""

    def __init__(
        self,
        job: JobConfig,
        run: RunDirectory,
        group: WorkerGroup,
        store: RendezvousStore,
        *,
        chaos: ChaosControl,
        launched: float,
        progress: bool = False,
        resume: ResumePoint | None = None,
        lease: NamespaceLease | None = None,
    ) -> None:
        self.job = job
        self.run = run
        self.group = group
        self.store = store
        self.chaos = chaos
        self.progress = progress
        self.resume = resume
        self.counters = dict.fromkeys(EVENT_COUNTERS, 0)
        self.checkpoints = CheckpointCoordinator(job, run, self.counters, lease)
        self.accounting = StepAccounting(job, run, group, self.checkpoints, self.counters, launched)
        self.joiners = JoinerPool(group, job.scaling.max_workers, lambda: chaos.dead_nodes)
        self.recovery = RecoveryProcedure(job, run, group, store, chaos, self.checkpoints, self.accounting, self.joiners)
        self.accounting.observers.append(self.recovery.step_completed)
        self.state: State = Starting()
        self.stragglers: StragglerControl | None = None
        self.num_steps = 0
        self.train_s = 0.0
        self._train_started: float | None = None
        self._pipeline: StepPipeline | None = None
        self.run_ahead = RunAhead(job.worker.max_steps_per_call)
        self.meter = ControlPlaneMeter(server_cpu_s=store.server_cpu_s)

    def execute(self) -> JobResult:
        """Run the job to a terminal state; returns the run directory and its summary (also
        saved there) whatever the outcome."""
        self.run.event("job_start", name=self.job.name, config=self.job.model_dump(mode="json"))
        workers = {"start": self.job.scaling.workers}
        try:
            while not is_terminal(self.state):
                self._step()
        finally:
            workers["end"] = self.group.size
            self.checkpoints.abandon("the job ended")
            self.group.shutdown()
            try:
                self.chaos.finish(self.store)
            except (RuntimeError, OSError) as err:  # the summary matters more than the report
                self.run.event("error", message=f"chaos report: {type(err).__name__}: {err}")
            self.accounting.close_progress()
        summary = self.accounting.summary(
            self.state, num_steps=self.num_steps, train_s=self.train_s, workers=workers, control_plane=self.meter.summary()
        )
        self.run.event("job_end", status=summary["status"])
        self.run.save_summary(summary)
        self.run.close()
        return JobResult(self.run.path, summary)

    def _step(self) -> tuple[State, State]:
        """Run the current state's handler once; returns (previous, next). A dead store
        (StoreFailed, a JobFailed) fails the job whatever the state was doing: checked first,
        so it is named even where nothing touches the store (mitigation off, no rendezvous)."""
        previous = self.state
        try:
            self.store.check_alive()
            following = self._handle(previous)
        except KeyboardInterrupt:
            following = Stopped("interrupted")
        except (JobFailed, CallFailed, WorkerGroupError, ChaosError) as err:
            message = err.reason if isinstance(err, CallFailed) else f"{type(err).__name__}: {err}"
            self.run.event("error", message=message)
            following = Failed(message)
        check_transition(previous, following)
        if following.kind is not previous.kind:
            self.run.event("state", old=previous.kind.value, new=following.kind.value, reason=following.reason)
        self.state = following
        return previous, following

    def _handle(self, state: State) -> State:
        if isinstance(state, Starting):
            return self._starting()
        if isinstance(state, Running):
            return self._running(state)
        if isinstance(state, Recovering):
            return self._recovering(state)
        if isinstance(state, Growing):
            return self._growing()
        if isinstance(state, CheckpointingBeforeFailure):
            return self._checkpointing_before_failure(state)
        raise AssertionError(f"no handler for {state}")

    # Starting

    def _starting(self) -> State:
        info = self.group.start(self.job.scaling.workers)
        self.accounting.mark("workers_started")
        self.accounting.workers_launched(info)
        self.num_steps = info[0].num_steps
        if self.resume is not None:
            self._restore(self.resume)
        self.group.form_group(self.store)
        self.stragglers = StragglerControl(self.job, self.group.workers, self.counters, self.run.event)
        self.accounting.observers.append(self.stragglers.observe)
        if self.resume is not None:
            saved = self.resume.meta.get("stragglers", {})
            self.stragglers.expected_shard_s = float(saved.get("expected_shard_s", 0.0))
        self.accounting.mark("group_formed")
        self.run.event("workers_ready", workers=[i.to_json() for i in info], startup_s=dict(self.accounting.startup_s))
        self.accounting.show_progress(self.num_steps, self.progress)
        return Running(self.accounting.ledger.steps_done)

    def _restore(self, point: ResumePoint) -> None:
        """Load the checkpoint (into rank 0, the others taking it when the group forms; sharded,
        every rank its slice) and go on from its step, with its counters."""
        if point.step > self.num_steps:
            raise JobFailed(f"checkpoint {point.name} is at step {point.step}, past this job's {self.num_steps} steps")
        self.group.restore(point.root, point.name, point.manifest)
        self.accounting.ledger.resume_at(point.step)
        self.checkpoints.resumed(point)
        self.run.event("resume", checkpoint=point.name, step=point.step, skipped=point.skipped)

    # Running

    def _running(self, state: Running) -> State:
        """One turn of training: top up the batches in flight, wait for the oldest, commit its
        steps. Leaves for Growing or Recovering at a drained step boundary (joiners ready,
        workers to evict), for Recovering on a failure, for Finished after the last step."""
        if self._train_started is None:
            self._train_started = time.perf_counter()
        if self._pipeline is None:  # entering Running: nothing in flight
            self._pipeline = StepPipeline(self.group, state.next_step, self.run_ahead, self)
            self.run_ahead.restart()
            self.meter.restart()
        pipeline = self._pipeline
        if self.accounting.ledger.steps_done >= self.num_steps:
            return self._finish()
        self.checkpoints.poll(elapsed_s=time.perf_counter() - self._train_started)
        joining = self.joiners.want_to_join()
        evictions = self._stragglers().pending_evictions
        if not joining and not evictions:
            pipeline.top_up(self.num_steps)
        if not pipeline.in_flight:  # drained for a change at this step boundary
            self._pipeline = None
            if evictions:
                return Recovering(StepOutcome(evict=list(evictions)))
            return Growing()
        batch = pipeline.in_flight.popleft()
        for step in batch.steps:
            self.chaos.during_step(self.group, step)
        try:
            outcome = await_step(self.group, batch, self.job, self._stragglers().evicting)
        except JobFailed:
            # A step timed out: the steps before it every replica applied are done all the same.
            self._pipeline = None
            self.recovery.commit_applied((batch, *pipeline.drain()), (), self.group.progress(PROBE_S))
            raise
        self.meter.waited(outcome.waited_s)
        if outcome.evict or outcome.failed:
            in_flight = (batch, *pipeline.drain())
            self._pipeline = None
            return Recovering(outcome, in_flight)
        quiet = True
        for record in outcome.records:
            self.accounting.commit(record.step, record, complete=True)
            quiet = quiet and self._stragglers().quiet
        self.run_ahead.observe(quiet)
        self.meter.committed(outcome.records)
        return Running(pipeline.next_step)

    # The pipeline's hooks (``orchestrator.steps.pipeline.BatchHooks``)

    def hold(self, first: int, count: int) -> bool:
        """Whether to submit the batch of ``count`` steps from ``first`` later: a checkpoint is
        due inside it (or where it starts) and the last one is still being written (submitted
        now, it would go without; after the next commit the write has likely ended)."""
        return self.checkpoints.due_behind_pending(max(first, min(first + count, self.num_steps - 1)))

    def boundary(self, step: int) -> bool:
        """Whether the driver acts before ``step`` (chaos; a checkpoint due there while the
        last is still being written, taken between two batches once it is): no batch runs past
        it. Otherwise a checkpoint does not end a batch: it is taken inside
        (``snapshot_inside``)."""
        return self.chaos.acts_at(step) or self.checkpoints.due_behind_pending(step)

    def snapshot_inside(self, first: int, count: int) -> SnapshotOrder | None:
        """The periodic checkpoint due after one of the steps ``first`` .. ``first + count - 1``
        (before the job's last: the final one is taken apart), ordered now to ride with their
        batch; None if none is due there (or one is still being written)."""
        for step in range(first + 1, min(first + count, self.num_steps - 1) + 1):
            if self.checkpoints.due(step):
                return self.checkpoints.order(self.group, step, self._policy_state())
        return None

    def plan(self, step: int) -> StepPlan:
        plan = self._stragglers().plan(step)
        if plan.mitigating and not plan.clean:  # a clean step's claims are made only if someone is late
            claims = self.store.claims
            trips, sent = claims.round_trips, claims.bytes
            self.store.call(f"opening step {step}'s shard claims", open_step, claims, step, plan)
            self.meter.driver_store(claims.round_trips - trips, claims.bytes - sent)
        return plan

    def before_submit(self, step: int) -> None:
        self.chaos.at_boundary(step)
        if self.checkpoints.due(step):
            self.checkpoints.start(self.group, step, self._policy_state())

    def _finish(self) -> State:
        if self._train_started is not None:
            self.train_s = time.perf_counter() - self._train_started
        self.checkpoints.poll(wait_s=self.job.timeouts.checkpoint_s)
        self.checkpoints.save_now(self.group, self.accounting.ledger.steps_done, self._policy_state(), "final")
        metrics = self.group.evaluate(self.job.timeouts.step_s)
        self.run.event("eval", step=self.accounting.ledger.steps_done, metrics=metrics)
        self.run.save_model(self.group.model_state(self.job.timeouts.step_s))
        return Finished(metrics)

    # Recovering

    def _recovering(self, state: Recovering) -> State:
        return self.recovery.recover(state, self._stragglers())

    def _checkpointing_before_failure(self, state: CheckpointingBeforeFailure) -> State:
        if state.holders and self.job.sharding.enabled:
            # Each survivor holds its slice of the optimizer state: no one worker can write it all.
            self.run.event(
                "checkpoint_skipped", reason="sharded optimizer state is spread over the workers: the newest "
                "checkpoint written before the failure stands",
            )
        elif state.holders:
            root, step = pick_root(dict(state.holders))
            self.group.lead_with(root)
            if self.checkpoints.save_now(self.group, step, self._policy_state(), "before failing", ranks=1, force=True):
                self.recovery.commit_held(state.in_flight, state.records, step)  # held by the checkpoint now
        raise JobFailed(state.reason)

    # Growing

    def _growing(self) -> State:
        """Ready workers join and take the state from rank 0; a death meanwhile is recovered
        from (the newcomers hold no state yet)."""
        joined = self.joiners.admit()
        self.counters["joins"] += len(joined)
        started = time.time()
        try:
            transfer_s = self.group.form_group(self.store)
        except (CallFailed, WorkerGroupError) as err:
            self.run.event("reform_failed", error=str(err))
            # Whatever a join raised, its cure is re-forming (as after a failed join in a
            # recovery), not failing the job.
            outcome = StepOutcome()
            if isinstance(err, CallFailed):
                outcome.record(err, cured_by_reforming=True)
            return Recovering(outcome, without_state=frozenset(joined), cause=f"growing: {err}")
        self._stragglers().set_workers(self.group.workers)
        self.run.event(
            "grow", at_step=self.accounting.ledger.steps_done, joined=joined, workers=self.group.workers,
            transfer_s=transfer_s, reform_s=time.time() - started - transfer_s,
            sharding=sharding_of(self.job.sharding, self.group.size),
        )
        return Running(self.accounting.ledger.steps_done, f"{self.group.size} workers")

    # Helpers

    def _stragglers(self) -> StragglerControl:
        assert self.stragglers is not None, "group not formed"
        return self.stragglers

    def _policy_state(self) -> dict[str, Any]:
        """What the driver's policies learned, for a checkpoint's manifest (the interval policy's
        own state is added by the coordinator)."""
        return {"stragglers": {"expected_shard_s": self._stragglers().expected_shard_s}}
