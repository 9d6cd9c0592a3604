"""The job controller: owns a job from start to summary as a loop over states
(``orchestrator/states.py``; docs/architecture.md, "The controller").

Each state's handler does its work and returns the next state; ``_step`` runs one handler and
returns ``(previous, next)``; every change of kind is an event in ``events.jsonl``. The
controller talks to workers only through a ``WorkerGroup`` (``orchestrator/group.py``): Ray
actors in a job, an in-process fake in ``tests/test_recovery.py``.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from tqdm import tqdm

from jobspec.job import JobConfig
from jobspec.wire import StepTelemetry, WorkerInfo
from orchestrator.chaos_control import ChaosControl, ChaosError
from orchestrator.checkpointing import CheckpointCoordinator, ResumePoint
from orchestrator.control_meter import ControlPlaneMeter
from orchestrator.errors import JobFailed
from orchestrator.group import CallFailed, WorkerGroup, WorkerGroupError
from orchestrator.ledger import CommitLedger
from orchestrator.membership import JoinerPool
from orchestrator.metrics import JobMetrics
from orchestrator.pipeline import InFlight, StepOutcome, StepPipeline, await_step, batch_reports
from orchestrator.recovery import (
    MAX_REFORMS,
    GiveUp,
    Recovery,
    RecoveryLog,
    Reformer,
    first_uncommitted,
    settle,
    steps_to_redo,
)
from orchestrator.rendezvous import RendezvousStore
from orchestrator.run_dir import RunDirectory
from orchestrator.states import (
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
from orchestrator.store_process import StoreProcessError
from orchestrator.straggler_control import StragglerControl
from orchestrator.summary import EVENT_COUNTERS, JobResult, job_goodput, job_summary
from policies.elasticity import pick_root
from policies.goodput import Goodput
from policies.run_ahead import RunAhead
from policies.work_stealing import StepPlan
from workers.claims import open_step


class JobController:
    """Runs one job on ``group`` (not started yet), meeting its workers at ``store``: start,
    train, evaluate, save, summarise (see the module doc). ``launched``: ``perf_counter()`` at
    launch, for start-up milestones; ``resume``: the checkpoint to go on from."""

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
        metrics: JobMetrics | None = None,
    ) -> None:
        self.job = job
        self.run = run
        self.group = group
        self.store = store
        self.chaos = chaos
        self.launched = launched
        self.progress = progress
        self.resume = resume
        self.metrics = metrics
        self.startup_s: dict[str, float] = {}
        self.counters = dict.fromkeys(EVENT_COUNTERS, 0)
        self.ledger = CommitLedger(job.shards)
        self.checkpoints = CheckpointCoordinator(job, run, self.counters)
        self.recoveries = RecoveryLog()
        self.joiners = JoinerPool(group, job.scaling.max_workers, lambda: chaos.dead_nodes)
        self.reformer = Reformer(group, store, self.joiners, job.scaling, job.timeouts.collective_s, self._failed_join)
        self.state: State = Starting()
        self.stragglers: StragglerControl | None = None
        self.num_steps = 0
        self.train_s = 0.0
        self._train_started: float | None = None
        self._bar: tqdm | None = None
        self._failed_in_a_row = 0  # recoveries with nobody dead since the last completed step
        self._pipeline: StepPipeline | None = None
        self.run_ahead = RunAhead(job.worker.max_steps_per_call)
        self.meter = ControlPlaneMeter(server_cpu_s=store.server_cpu_s)

    def mark(self, milestone: str, seconds: float | None = None) -> None:
        """Record a start-up milestone, in seconds since launch (now, unless given)."""
        self.startup_s[milestone] = time.perf_counter() - self.launched if seconds is None else seconds

    def _mark_worker_launch(self, info: list[WorkerInfo]) -> None:
        """The slowest worker's process start, code loaded and model built, in seconds since
        launch (wall clocks: on a cluster as exact as the nodes' clocks agree)."""
        launched_at = time.time() - (time.perf_counter() - self.launched)
        started = [i.started_at for i in info if i.started_at is not None]
        if started:
            self.mark("worker_process_started", max(started) - launched_at)
        self.mark("worker_code_loaded", max(i.imported_at for i in info) - launched_at)
        self.mark("worker_built", max(i.built_at for i in info) - launched_at)

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
            if self._bar is not None:
                self._bar.close()
        summary = self._summary(workers)
        self.run.event("job_end", status=summary["status"])
        self.run.save_summary(summary)
        self.run.close()
        return JobResult(self.run.path, summary)

    def _step(self) -> tuple[State, State]:
        """Run the current state's handler once; returns (previous, next)."""
        previous = self.state
        try:
            following = self._handle(previous)
        except KeyboardInterrupt:
            following = Stopped("interrupted")
        except (JobFailed, CallFailed, WorkerGroupError, ChaosError, StoreProcessError) as err:
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
        self.mark("workers_started")
        self._mark_worker_launch(info)
        self.num_steps = info[0].num_steps
        if self.resume is not None:
            self._restore(self.resume)
        self.group.form_group(self.store)
        self.stragglers = StragglerControl(self.job, self.group.workers, self.counters, self.run.event)
        if self.resume is not None:
            saved = self.resume.meta.get("stragglers", {})
            self.stragglers.expected_shard_s = float(saved.get("expected_shard_s", 0.0))
        self.mark("group_formed")
        self.run.event("workers_ready", workers=[i.to_json() for i in info], startup_s=dict(self.startup_s))
        self._bar = tqdm(
            total=self.num_steps, initial=self.ledger.steps_done, unit="step", disable=not self.progress, dynamic_ncols=True
        )
        return Running(self.ledger.steps_done)

    def _restore(self, point: ResumePoint) -> None:
        """Load the checkpoint into rank 0 (the others take it when the group forms) and go on
        from its step, with its counters."""
        if point.step > self.num_steps:
            raise JobFailed(f"checkpoint {point.name} is at step {point.step}, past this job's {self.num_steps} steps")
        self.group.restore(point.root, point.name, point.manifest)
        self.ledger.resume_at(point.step)
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
            self._pipeline = StepPipeline(self.group, state.next_step, self._plan, self.run_ahead, self._boundary)
            self.run_ahead.restart()
            self.meter.restart()
        pipeline = self._pipeline
        if self.ledger.steps_done >= self.num_steps:
            return self._finish()
        self.checkpoints.poll(elapsed_s=time.perf_counter() - self._train_started)
        joining = self.joiners.want_to_join()
        evictions = self._stragglers().pending_evictions
        if not joining and not evictions:
            pipeline.top_up(self.num_steps, self._before_submit, self._hold)
        if not pipeline.in_flight:  # drained for a change at this step boundary
            self._pipeline = None
            if evictions:
                return Recovering(StepOutcome(evict=list(evictions)))
            return Growing()
        batch = pipeline.in_flight.popleft()
        for step in batch.steps:
            self.chaos.during_step(self.group, step)
        outcome = await_step(self.group, batch, self.job, self._stragglers().evicting)
        self.meter.waited(outcome.waited_s)
        if outcome.evict or outcome.failed:
            in_flight = (batch, *pipeline.drain())
            self._pipeline = None
            return Recovering(outcome, in_flight)
        quiet = True
        by_rank = [outcome.reports[r] for r in sorted(outcome.reports)]
        for index, step in enumerate(batch.steps):
            self._commit(step, [reports[index] for reports in by_rank], complete=True)
            quiet = quiet and self._stragglers().quiet
        self.run_ahead.observe(quiet)
        self.meter.committed(by_rank)
        return Running(pipeline.next_step)

    def _hold(self, step: int) -> bool:
        """Whether to submit ``step`` later: a checkpoint is due before it and the last one is
        still being written (submitted now, it would go without; after the next commit the
        write has likely ended, as it had with one step in flight)."""
        return self.checkpoints.pending is not None and self.checkpoints.would_be_due(step)

    def _boundary(self, step: int) -> bool:
        """Whether the driver acts before ``step`` (a checkpoint, chaos): no batch runs past it."""
        return self.checkpoints.would_be_due(step) or self.chaos.acts_at(step)

    def _plan(self, step: int) -> StepPlan:
        plan = self._stragglers().plan(step)
        if plan.mitigating:
            claims = self.store.claims
            trips, sent = claims.round_trips, claims.bytes
            open_step(claims, step, plan)
            self.meter.driver_store(claims.round_trips - trips, claims.bytes - sent)
        return plan

    def _before_submit(self, step: int) -> None:
        self.chaos.at_boundary(step)
        if self.checkpoints.due(step):
            self.checkpoints.start(self.group, step, self._policy_state())

    def _finish(self) -> State:
        if self._train_started is not None:
            self.train_s = time.perf_counter() - self._train_started
        self.checkpoints.poll(wait_s=self.job.timeouts.checkpoint_s)
        self.checkpoints.save_now(self.group, self.ledger.steps_done, self._policy_state(), "final")
        metrics = self.group.evaluate(self.job.timeouts.step_s)
        self.run.event("eval", step=self.ledger.steps_done, metrics=metrics)
        self.run.save_model(self.group.model_state(self.job.timeouts.step_s))
        return Finished(metrics)

    def _commit(self, step: int, reports: list[StepTelemetry], *, complete: bool) -> None:
        """Account a committed step (``complete``: every rank's report is here)."""
        self.ledger.commit(step, reports, complete=complete)
        if "first_step" not in self.startup_s:
            self.mark("first_step")
        if reports:
            self.run.telemetry(reports)
        if complete:
            self._stragglers().observe(step, reports)
            self._failed_in_a_row = 0
        step_s = max((r.step_s for r in reports), default=0.0)
        self.checkpoints.observe_step(step_s)
        self.run.event(
            "step", step=step, loss=self.ledger.final_loss, samples=reports[0].global_samples if reports else None,
            step_s=step_s, **_step_figures(reports[0], step_s) if reports else {},
        )
        closed = self.recoveries.committed(step)
        if closed is not None:
            self.run.event("recovered", **closed.to_json())
        self._record_metrics(reports, step_s, closed)
        if self._bar is not None:
            self._bar.update(1)
            if self.ledger.final_loss is not None:
                self._bar.set_postfix(loss=f"{self.ledger.final_loss:.4f}", refresh=False)

    # Recovering

    def _recovering(self, state: Recovering) -> State:
        """Abort every member, find the dead, commit what some survivor finished, re-form
        without the dead and the evicted (with any ready replacements) and redo the steps that
        were in flight. Fails if the failure is not a lost worker."""
        noticed = time.time()
        outcome = state.outcome
        # A silent worker (stalled, hung, partitioned) is a failure: replaced, its slot kept.
        # One persistently far slower is evicted: its slot is retired (a replacement there
        # would likely be as slow).
        silent = {e.worker: f"silent for {e.evidence.get('silent_s')}s (stalled or hung)" for e in outcome.evict if e.reason == "silent"}
        evicted = [e.worker for e in outcome.evict if e.worker not in silent]
        for eviction in outcome.evict:
            self.counters["evictions"] += eviction.worker not in silent
            self.run.event(
                "evict", at_step=self.ledger.steps_done, worker=eviction.worker, reason=eviction.reason,
                evidence=eviction.evidence,
            )
        leaving = frozenset(evicted) | frozenset(silent)
        settled = settle(self.group, self.store.generation, state.in_flight, leaving, self.job.timeouts.collective_s)
        dead = sorted((outcome.dead | set(settled.lost) | set(silent)) - set(evicted))
        # A worker judged dead never carries the state on, even if it still answers (Ray's
        # ActorUnavailableError: it may or may not have run); it is removed below.
        alive = {w: p for w, p in settled.alive.items() if w not in dead}
        failed_step = state.in_flight[0].step if state.in_flight else self.ledger.steps_done
        if not dead and not evicted:
            if outcome.user_error is not None:
                self.store.check_alive()  # a dead store makes every worker's call fail too
                raise JobFailed(f"step {failed_step}: {outcome.user_error}")
            # Collectives failed with every member alive (a network fault): re-form and retry,
            # but not forever.
            self._failed_in_a_row += 1
            if self._failed_in_a_row > MAX_REFORMS:
                raise JobFailed(f"step {failed_step} failed {MAX_REFORMS} times in a row: {outcome.errors}")
        # Where the furthest survivor is; committed only once the re-formed group holds it.
        furthest = first_uncommitted(alive, self.ledger.steps_done)
        died_at = [t for w in dead if (t := self.chaos.death_time(self.store, w)) is not None]
        recovery = Recovery(
            at_step=furthest,
            workers=dead + evicted,
            reasons={
                **{w: silent.get(w) or outcome.errors.get(w, "did not answer") for w in dead},
                **{w: "evicted" for w in evicted},
            },
            started=min(died_at) if died_at else noticed,
        )
        recovery.detect_s = time.time() - recovery.started
        if dead:
            self.counters["failures"] += len(dead)
            self.run.event("failure", at_step=furthest, workers=dead, reasons=recovery.reasons, detect_s=recovery.detect_s)
            self.checkpoints.observe_failure()
        self.group.remove(dead)
        self.group.remove(evicted, retire=True)
        self.checkpoints.abandon(f"worker(s) {dead + evicted} left the group")
        reforming = time.time()
        reformed = self.reformer.reform(alive, self.ledger.steps_done, state.without_state)
        if isinstance(reformed, GiveUp):
            return CheckpointingBeforeFailure(reformed.holders, reformed.reason, state.in_flight, outcome.reports)
        next_step = reformed.next_step
        self._commit_held(state.in_flight, outcome.reports, next_step)
        redo = steps_to_redo(state.in_flight, next_step, max((p.step for p in alive.values()), default=next_step))
        recovery.at_step = next_step
        recovery.workers += list(reformed.lost)
        self.counters["joins"] += len(reformed.joined)
        recovery.transfer_s, recovery.waited_s = reformed.transfer_s, reformed.waited_s
        recovery.reform_s = time.time() - reforming - reformed.transfer_s  # every attempt, and waiting
        self._stragglers().set_workers(self.group.workers)
        if dead or redo:
            self.counters["recoveries"] += 1
            self.counters["steps_redone"] += len(redo)
            recovery.redo_steps = redo
            self.recoveries.opened(recovery)
        self.run.event("group_reformed", workers=self.group.workers, redo=redo, transfer_s=recovery.transfer_s)
        return Running(next_step, f"{self.group.size} workers")

    def _commit_held(
        self, in_flight: tuple[InFlight, ...], known: Mapping[int, list[StepTelemetry]], through: int
    ) -> None:
        """Commit the steps in flight before ``through``, the next step of the state the group
        (or the checkpoint) now holds: a survivor applied them and the census proved each.
        ``known``: the reports of the first batch in flight that came in, by rank."""
        for batch in in_flight:
            if batch.step >= through:
                break
            reports = batch_reports(self.group, batch, known if batch is in_flight[0] else {})
            for step in batch.steps:
                if step >= through:
                    break
                self._commit(step, reports[step], complete=False)

    def _failed_join(self, lost: list[int], error: str) -> None:
        self.run.event("reform_failed", error=error)
        self.counters["failures"] += len(lost)
        if lost:
            self.run.event("failure", at_step=self.ledger.steps_done, workers=lost, reasons={}, detect_s=None)

    def _checkpointing_before_failure(self, state: CheckpointingBeforeFailure) -> State:
        if state.holders:
            root, step = pick_root(dict(state.holders))
            self.group.lead_with(root)
            if self.checkpoints.save_now(self.group, step, self._policy_state(), "before failing", ranks=1, force=True):
                self._commit_held(state.in_flight, state.reports, step)  # held by the checkpoint now
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
            "grow", at_step=self.ledger.steps_done, joined=joined, workers=self.group.workers,
            transfer_s=transfer_s, reform_s=time.time() - started - transfer_s,
        )
        return Running(self.ledger.steps_done, f"{self.group.size} workers")

    # Helpers

    def _stragglers(self) -> StragglerControl:
        assert self.stragglers is not None, "group not formed"
        return self.stragglers

    def _policy_state(self) -> dict[str, Any]:
        """What the driver's policies learned, for a checkpoint's manifest (the interval policy's
        own state is added by the coordinator)."""
        return {"stragglers": {"expected_shard_s": self._stragglers().expected_shard_s}}

    def _goodput(self, finishing: bool = False) -> Goodput:
        """The goodput account so far. ``finishing``: the job is past its last step; the time
        since (or since the group formed, if no step committed) is charged to finishing, with
        the checkpoints and recovery spans inside it."""
        now = time.perf_counter()
        steps_done = self.ledger.steps_done
        recoveries = self.recoveries.done + ([self.recoveries.open] if self.recoveries.open else [])
        copies = [r.copy_s for r in self.checkpoints.written]
        finishing_s = 0.0
        if finishing:
            last = self.ledger.last_commit_s
            since = last if last is not None else self.launched + self.startup_s.get("group_formed", 0.0)
            finishing_s = max(0.0, now - since)
            copies = [r.copy_s for r in self.checkpoints.written if r.step < steps_done]
            if self.recoveries.open is not None and last is not None:
                recoveries = self.recoveries.done  # it was still redoing: inside finishing
        return job_goodput(now - self.launched, self.startup_s, self.ledger, recoveries, copies, finishing_s)

    def _record_metrics(
        self, reports: list[StepTelemetry] | None, step_s: float, closed: Recovery | None, final: Goodput | None = None
    ) -> None:
        """Record a committed step's metrics (``reports``), or at the end (None) the counters,
        last checkpoint and ``final`` goodput. A failure to is reported once and stops the
        recording: metrics never fail a job."""
        metrics = self.metrics
        if metrics is None:
            return
        try:
            if reports is None:
                metrics.observe_counters(self.counters)
            else:
                metrics.observe_step(
                    reports, step_s, self.ledger.steps_done, self.group.size, self.counters, self._goodput()
                )
            if closed is not None:
                metrics.observe_recovery(
                    {"detect": closed.detect_s, "reform": closed.reform_s, "transfer": closed.transfer_s, "redo": closed.redo_s}
                )
            if self.checkpoints.written:
                metrics.observe_checkpoint(self.checkpoints.written[-1].copy_s, self.checkpoints.written[-1].write_s)
            if final is not None:
                metrics.observe_goodput(final)
        except Exception as err:  # noqa: BLE001 - Ray's metrics agent, our accounting: never the job's end
            self.metrics = None
            self.run.event("metrics_failed", error=f"{type(err).__name__}: {err}")

    def _summary(self, workers: dict[str, int]) -> dict[str, Any]:
        state = self.state
        goodput = self._goodput(finishing=True)
        self._record_metrics(None, 0.0, None, goodput)  # the final checkpoint and counters, too
        return job_summary(
            self.job, state.kind.value, self.ledger, self.num_steps,
            started=self.launched, train_s=self.train_s, startup_s=self.startup_s,
            metrics=dict(state.metrics) if isinstance(state, Finished) else {}, workers=workers,
            counters=self.counters, recoveries=self.recoveries.done, checkpoints=self.checkpoints.summary(),
            goodput=goodput, control_plane=self.meter.summary(), error=state.reason if isinstance(state, (Failed, Stopped)) else None,
        )


def _step_figures(report: StepTelemetry, step_s: float) -> dict[str, Any]:
    """What a step event tells of the step's optimisation, from one rank's report (they agree)."""
    figures: dict[str, Any] = {
        "lr": report.lr, "grad_norm": report.grad_norm, "weight": report.weight,
        "weight_per_s": report.weight / step_s if step_s > 0 else None,
    }
    if report.skipped:
        figures["skipped"] = True
    return figures
