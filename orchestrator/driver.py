"""The driver: owns a job from start to summary and runs its control loop."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from tqdm import tqdm

from orchestrator.chaos_control import ChaosControl, ChaosError
from orchestrator.checkpointing import CheckpointCoordinator, ResumePoint
from orchestrator.config import JobConfig
from orchestrator.run_dir import RunDirectory
from orchestrator.state import JobState, JobStateMachine
from orchestrator.straggler_control import StragglerControl
from orchestrator.worker_group import Member, RendezvousStore, WorkerGroup, WorkerGroupError
from policies.elasticity import admit_count, after_failure, pick_root
from policies.eviction import Evict, silent_workers
from workers.actor import WorkerSpec
from workers.claims import SLOTS, open_step
from workers.comm_group import CollectiveAborted, CollectiveTimeout
from workers.telemetry import StepTelemetry

# Steps submitted ahead of the one being collected: the driver's round trip and bookkeeping
# overlap the workers' compute instead of sitting between steps.
STEPS_IN_FLIGHT = 2
assert STEPS_IN_FLIGHT < SLOTS, "open steps must not share claim slots"

EVENT_COUNTERS = (
    "failures",
    "recoveries",
    "steps_redone",
    "stragglers_detected",
    "speculative_shards",
    "speculative_won",
    "stolen_shards",
    "rebalances",
    "checkpoints",
    "evictions",
    "joins",
)

# How long the driver waits for every member's progress() when it looks for the dead: the
# control group answers in milliseconds even mid-step, so silence this long means a dead
# process (or a node Ray has not declared dead yet).
PROBE_S = 3.0
# Re-forming attempts in a row (each after a further failure) before the job gives up.
MAX_REFORMS = 5
# While a step runs the driver looks at the workers' finished calls this often: the bound on
# how late it sees a failure (one wait per step when steps are shorter).
FAILURE_POLL_S = 0.05
# At most this often the driver looks for free slots to start workers in (a GCS round trip).
FILL_EVERY_S = 1.0


class JobFailed(RuntimeError):
    """The job could not finish; the run directory's summary says why."""


@dataclass(frozen=True)
class JobResult:
    run_dir: Path
    summary: dict[str, Any]


def worker_spec(job: JobConfig) -> WorkerSpec:
    return WorkerSpec(
        model_factory=job.model.factory,
        model_kwargs=dict(job.model.kwargs),
        dataset_factory=job.dataset.factory,
        dataset_kwargs=dict(job.dataset.kwargs),
        eval_factory=job.eval.factory if job.eval else None,
        eval_kwargs=dict(job.eval.kwargs) if job.eval else {},
        loss=job.loss,
        optimizer=job.optimizer.name,
        optimizer_kwargs=dict(job.optimizer.kwargs),
        batch_size=job.batch_size,
        num_shards=job.shards,
        seed=job.seed,
        steps=job.steps,
        epochs=job.epochs,
        fuse_shards=job.worker.fuse_shards,
        algorithm=job.collective.algorithm,
        compression=job.collective.compression,
        topk_ratio=job.collective.topk_ratio,
        bucket_bytes=int(job.collective.bucket_mb * 2**20),
        overlap=job.collective.overlap,
        collective_timeout_s=job.timeouts.collective_s,
        chaos_slow=tuple((c.rank, c.factor, c.from_step, c.to_step) for c in job.chaos.slow),
        chaos_stall=tuple((c.rank, c.at_step, c.seconds) for c in job.chaos.stall),
        chaos_kill=tuple((c.rank, c.at_step, c.during) for c in job.chaos.kill if c.how == "sigkill" and c.rank is not None),
    )


@dataclass
class StepWait:
    """How waiting for one step ended: every report in (``reports`` by rank), workers to
    ``evict`` for holding it up, or a failure: ``errors`` by worker id (``dead`` for those Ray
    says died), with the reports that did come in."""

    reports: dict[int, StepTelemetry] = field(default_factory=dict)
    evict: list[Evict] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)
    user_error: BaseException | None = None

    @property
    def failed(self) -> bool:
        return bool(self.errors)


@dataclass
class Recovery:
    """One recovery's time split, in seconds: ``detect`` (from the death, when known, else from
    the first error seen, to knowing who is dead), ``reform`` (removing them, starting over the
    rendezvous), ``transfer`` (state broadcast from the surviving root), ``redo`` (re-running
    the steps that were in flight). ``first_step_s``: from the death to the next completed step."""

    at_step: int
    workers: list[int]
    reasons: dict[int, str]
    started: float  # time.time() of the death (or of the first error seen)
    detect_s: float = 0.0
    reform_s: float = 0.0
    transfer_s: float = 0.0
    redo_s: float | None = None
    first_step_s: float | None = None
    redo_steps: list[int] = field(default_factory=list)
    reformed_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "at_step": self.at_step, "workers": self.workers, "reasons": self.reasons,
            "detect_s": self.detect_s, "reform_s": self.reform_s, "transfer_s": self.transfer_s,
            "redo_s": self.redo_s, "first_step_s": self.first_step_s, "redo_steps": self.redo_steps,
        }


def _finished(refs: list[ray.ObjectRef], known: dict[int, StepTelemetry]) -> list[StepTelemetry]:
    """The reports of the calls in ``refs`` that succeeded (``known`` by rank, else looked up)."""
    out = []
    for rank, ref in enumerate(refs):
        if rank in known:
            out.append(known[rank])
            continue
        try:
            out.append(ray.get(ref, timeout=0))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            continue
    return out


def _reason(err: BaseException) -> str:
    cause = getattr(err, "cause", None) or err
    return f"{type(cause).__name__}: {cause}".strip()


class JobDriver:
    """Runs one job: start workers, train, evaluate, save, summarise.

    The loop keeps ``STEPS_IN_FLIGHT`` steps queued on every worker and checks each finished
    step's shard coverage. A worker death (Ray's error, or a collective failing on its peers)
    is recovered in place: abort the survivors, re-form among them under a new generation,
    redo the steps that were in flight. Replacements and new workers join at step boundaries.
    Any other worker error, a timeout, or fewer than ``min_workers`` left fails the job.
    """

    def __init__(
        self,
        job: JobConfig,
        run: RunDirectory,
        *,
        progress: bool,
        launched: float,
        cluster: Any = None,
        node_cpus: float = 0,
        resume: ResumePoint | None = None,
    ) -> None:
        self.job = job
        self.run = run
        self.progress = progress
        self.launched = launched
        self.startup_s: dict[str, float] = {}
        self.machine = JobStateMachine(self._on_state)
        self.counters = dict.fromkeys(EVENT_COUNTERS, 0)
        self.samples = 0
        self.steps_done = 0
        self.shards_committed = 0
        self.final_loss: float | None = None
        self.train_s = 0.0
        self.stragglers: StragglerControl | None = None
        self.chaos = ChaosControl(job.chaos, cluster, node_cpus, run.event)
        self.checkpoints = CheckpointCoordinator(job, run, self.counters)
        self.resume = resume
        self.recoveries: list[Recovery] = []
        self._open_recovery: Recovery | None = None
        self._ready: list[Member] = []
        self._filled_at = 0.0
        self._failed_in_a_row = 0  # recoveries with nobody dead since the last completed step

    def mark(self, milestone: str, seconds: float | None = None) -> None:
        """Record a start-up milestone, in seconds since launch (now, unless given)."""
        self.startup_s[milestone] = time.perf_counter() - self.launched if seconds is None else seconds

    def _on_state(self, old: JobState, new: JobState, reason: str) -> None:
        self.run.event("state", old=old.value, new=new.value, reason=reason)

    def execute(self) -> JobResult:
        job = self.job
        self.run.event("job_start", name=job.name, config=job.model_dump(mode="json"))
        group = WorkerGroup(worker_spec(job), job.scaling, job.timeouts)
        num_steps = 0
        workers_start = job.scaling.workers
        metrics: dict[str, float] = {}
        error: str | None = None
        try:
            store = RendezvousStore(job.timeouts.rendezvous_s)
            info = group.start(job.scaling.workers)
            self.mark("workers_started")
            num_steps = int(info[0]["num_steps"])
            if self.resume is not None:
                self._resume(group, self.resume, num_steps)
            group.form_group(store)
            self.stragglers = StragglerControl(job, group.workers, self.counters, self.run.event)
            if self.resume is not None:
                saved = self.resume.meta.get("stragglers", {})
                self.stragglers.expected_shard_s = float(saved.get("expected_shard_s", 0.0))
            self.mark("group_formed")
            self.run.event("workers_ready", workers=info, startup_s=dict(self.startup_s))
            self.machine.to(JobState.RUNNING)
            self._train(group, store, num_steps)
            self.checkpoints.poll(wait_s=self.job.timeouts.checkpoint_s)
            self.checkpoints.save_now(group, self.steps_done, self._policy_state(), "final")
            metrics = group.call_rank(0, "evaluate", job.timeouts.step_s)
            self.run.event("eval", step=self.steps_done, metrics=metrics)
            self.run.save_model(group.call_rank(0, "model_state", job.timeouts.step_s))
            self.machine.to(JobState.FINISHED)
        except KeyboardInterrupt:
            error = "interrupted"
            self.machine.to(JobState.STOPPED, error)
        except (WorkerGroupError, ray.exceptions.RayError, JobFailed, ChaosError) as err:
            error = _reason(err)
            self.run.event("error", message=error)
            self.machine.to(JobState.FAILED, error)
        finally:
            workers_end = group.size
            self.checkpoints.abandon("the job ended")
            group.shutdown()
        summary = self._summary(num_steps, metrics, workers_start, workers_end, error)
        self.run.event("job_end", status=summary["status"])
        self.run.save_summary(summary)
        self.run.close()
        return JobResult(self.run.path, summary)

    def _resume(self, group: WorkerGroup, point: ResumePoint, num_steps: int) -> None:
        """Load the checkpoint into rank 0 (the others take it when the group forms) and go on
        from its step, with its counters."""
        if point.step > num_steps:
            raise JobFailed(f"checkpoint {point.name} is at step {point.step}, past this job's {num_steps} steps")
        group.restore(point.root, point.name, point.manifest)
        self.steps_done = point.step
        self.shards_committed = point.step * self.job.shards
        self.checkpoints.resumed(point)
        self.run.event("resume", checkpoint=point.name, step=point.step, skipped=point.skipped)

    def _train(self, group: WorkerGroup, store: RendezvousStore, num_steps: int) -> None:
        """Run every step, keeping ``STEPS_IN_FLIGHT`` queued. Evictions, failures and joins
        change the group between steps; aborted steps are redone from the first uncommitted."""
        inflight: deque[tuple[int, list[ray.ObjectRef]]] = deque()
        started = time.perf_counter()
        next_step = self.steps_done
        with tqdm(total=num_steps, initial=next_step, unit="step", disable=not self.progress, dynamic_ncols=True) as bar:
            while self.steps_done < num_steps:
                self.checkpoints.poll(elapsed_s=time.perf_counter() - started)
                joining = self._ready_to_join(group)
                pending = self._stragglers().pending_evictions
                while next_step < num_steps and len(inflight) < STEPS_IN_FLIGHT and not pending and not joining:
                    self.chaos.at_boundary(next_step)
                    if self.checkpoints.due(next_step):
                        self.checkpoints.start(group, next_step, self._policy_state())
                    plan = self._stragglers().plan(next_step)
                    if plan.mitigating:
                        open_step(store.claims, next_step, plan)
                    inflight.append((next_step, group.submit_step(next_step, plan)))
                    next_step += 1
                if not inflight:  # drained for a change at this step boundary
                    if pending:
                        self._recover(group, store, StepWait(evict=pending), [], bar)
                    else:
                        self._grow(group, store)
                    continue
                step, refs = inflight.popleft()
                waited = self._await_step(group, step, refs)
                if waited.evict or waited.failed:
                    next_step = self._recover(group, store, waited, [(step, refs), *inflight], bar)
                    inflight.clear()
                    continue
                self._collect(step, [waited.reports[r] for r in sorted(waited.reports)], bar, complete=True)
        self.train_s = time.perf_counter() - started

    def _stragglers(self) -> StragglerControl:
        assert self.stragglers is not None, "group not formed"
        return self.stragglers

    def _policy_state(self) -> dict[str, Any]:
        """What the driver's policies learned, for a checkpoint's manifest (the interval policy's
        own state is added by the coordinator)."""
        return {"stragglers": {"expected_shard_s": self._stragglers().expected_shard_s}}

    def _await_step(self, group: WorkerGroup, step: int, refs: list[ray.ObjectRef]) -> StepWait:
        """Wait for ``step``, looking at what has come in every ``FAILURE_POLL_S``, so the first
        failure is seen within that (most steps end within one wait). Returns the reports, the
        workers to evict for holding it up, or the failure. Raises JobFailed after
        ``timeouts.step_s``."""
        self.chaos.during_step(group, step)
        deadline = time.monotonic() + self.job.timeouts.step_s
        silent_s = self.job.stragglers.silent_s
        workers = group.workers
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        waited = StepWait()
        pending = list(refs)
        quiet_since = time.monotonic()
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise JobFailed(f"step {step} did not finish within {self.job.timeouts.step_s:.0f}s")
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(FAILURE_POLL_S, left))
            for ref in ready:
                rank = rank_of[ref]
                try:
                    waited.reports[rank] = ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError as err:
                    waited.errors[workers[rank]] = _reason(err)
                    waited.dead.add(workers[rank])
                except ray.exceptions.RayTaskError as err:
                    waited.errors[workers[rank]] = _reason(err)
                    if not isinstance(err.cause, (CollectiveAborted, CollectiveTimeout)):
                        waited.user_error = err  # a bug or bad data, not a lost peer
            if waited.failed:
                return waited
            if ready:
                quiet_since = time.monotonic()
            if not pending or time.monotonic() - quiet_since < silent_s or not self._stragglers().evicting:
                continue
            quiet_since = time.monotonic()
            progress = group.progress(timeout_s=min(5.0, silent_s))
            silent = silent_workers(step, progress, silent_s)
            if silent and group.size - len(silent) >= self.job.scaling.min_workers:
                waited.evict = silent
                return waited
        return waited

    def _recover(
        self,
        group: WorkerGroup,
        store: RendezvousStore,
        waited: StepWait,
        steps: list[tuple[int, list[ray.ObjectRef]]],
        bar: tqdm,
    ) -> int:
        """Change the group after a failure seen while waiting for ``steps[0]``, or to evict
        ``waited.evict``: abort every member, find the dead, commit what some survivor finished,
        re-form without the dead and the evicted (with any ready replacements) and return the
        first step to run again (``steps`` are the steps in flight; none at a drained
        boundary). Raises JobFailed if the failure is not a lost worker, or too few workers
        are left."""
        noticed = time.time()
        evicted = [e.worker for e in waited.evict]
        if evicted:
            self.machine.to(JobState.RECOVERING, f"evicting worker(s) {evicted}")
            for eviction in waited.evict:
                self.counters["evictions"] += 1
                self.run.event(
                    "evict", at_step=self.steps_done, worker=eviction.worker, reason=eviction.reason,
                    evidence=eviction.evidence,
                )
        else:
            self.machine.to(JobState.RECOVERING, f"step {steps[0][0]} failed: {waited.errors}")
        alive, silent = self._settle(group, store, steps, frozenset(evicted))
        dead = sorted((waited.dead | set(silent)) - set(evicted))
        if not dead and not evicted:
            if waited.user_error is not None:
                raise JobFailed(f"step {steps[0][0]}: {_reason(waited.user_error)}")
            # Collectives failed with every member alive (a network fault): re-form and retry,
            # but not forever.
            self._failed_in_a_row += 1
            if self._failed_in_a_row > MAX_REFORMS:
                raise JobFailed(f"step {steps[0][0]} failed {MAX_REFORMS} times in a row: {waited.errors}")
        # A step is committed once any survivor applied it: its all-reduce completed, and the
        # census on that survivor proved every shard counted exactly once.
        next_step = max((r["next_step"] for r in alive.values()), default=self.steps_done)
        for step, refs in steps:
            if step >= next_step:
                break
            self._collect(step, _finished(refs, waited.reports if step == steps[0][0] else {}), bar, complete=False)
        died_at = [t for w in dead if (t := self.chaos.death_time(store, w)) is not None]
        recovery = Recovery(
            at_step=next_step,
            workers=dead + evicted,
            reasons={**{w: waited.errors.get(w, "did not answer") for w in dead}, **{w: "evicted" for w in evicted}},
            started=min(died_at) if died_at else noticed,
        )
        recovery.detect_s = time.time() - recovery.started
        if dead:
            self.counters["failures"] += len(dead)
            self.run.event("failure", at_step=next_step, workers=dead, reasons=recovery.reasons, detect_s=recovery.detect_s)
            self.checkpoints.observe_failure()
        group.remove(dead)
        group.remove(evicted, retire=True)
        self.checkpoints.abandon(f"worker(s) {dead + evicted} left the group")
        redo = [s for s, _ in steps if s >= next_step]
        self._reform(group, store, alive, recovery)
        if dead or redo:
            self.counters["recoveries"] += 1
            self.counters["steps_redone"] += len(redo)
            recovery.redo_steps = redo
            recovery.reformed_at = time.time()
            self._open_recovery = recovery
        self.run.event("group_reformed", workers=group.workers, redo=redo, transfer_s=recovery.transfer_s)
        self.machine.to(JobState.RUNNING, f"{group.size} workers")
        return next_step

    def _settle(
        self,
        group: WorkerGroup,
        store: RendezvousStore,
        steps: list[tuple[int, list[ray.ObjectRef]]],
        leaving: frozenset[int] = frozenset(),
    ) -> tuple[dict[int, dict[str, Any]], list[int]]:
        """Abort every member's pending steps and wait until the survivors' (not ``leaving``
        ones') have ended, so what each survivor applied can no longer change; returns the
        survivors' progress reports and the workers that are dead or did not settle (those are
        killed with the dead)."""
        pending = [r for _, refs in steps for r in refs]
        group.abort_all(store.generation, pending, PROBE_S)
        alive, silent = group.probe(PROBE_S)
        # Dead actors' calls may take Ray a while to fail (a lost node); the survivors' end
        # within the abort poll, and only they matter now.
        rank_of = {w: r for r, w in enumerate(group.workers)}
        theirs = [refs[rank_of[w]] for _, refs in steps for w in alive if w not in leaving]
        _, stuck = ray.wait(theirs, num_returns=len(theirs), timeout=self.job.timeouts.collective_s)
        stuck_workers = {w for _, refs in steps for w in alive if w not in leaving and refs[rank_of[w]] in stuck}
        alive, more = group.probe(PROBE_S)
        staying = {w: r for w, r in alive.items() if w not in stuck_workers and w not in leaving}
        return staying, sorted(set(silent) | set(more) | stuck_workers)

    def _reform(self, group: WorkerGroup, store: RendezvousStore, alive: dict[int, dict[str, Any]], recovery: Recovery) -> None:
        """Bring the group to ``min_workers`` or more (waiting, bounded, for replacements) and
        form it with the survivor that applied the most steps as rank 0, ready replacements
        joining; a further death meanwhile starts this over (bounded). ``alive``: the members'
        progress reports. Raises JobFailed when too few workers are left."""
        waited_since = time.monotonic()
        for _ in range(MAX_REFORMS):
            # Only a member that applied every committed step holds the state (a worker that
            # was still joining holds none).
            holders = {w: r["next_step"] for w, r in alive.items() if r["next_step"] >= self.steps_done}
            self._fill(group, force=True)
            while True:
                self._ready += group.ready_joiners(timeout_s=0.0)
                decision = after_failure(
                    len(holders), group.size - len(holders) + len(self._ready), self.job.scaling.min_workers,
                    time.monotonic() - waited_since, self.job.scaling.wait_for_workers_s,
                )
                if decision.action == "continue":
                    break
                if decision.action == "fail":
                    self._save_before_failing(group, holders)
                    raise JobFailed(decision.reason)
                self._ready += group.ready_joiners(timeout_s=1.0)
                self._fill(group)
            root, _ = pick_root(holders)
            group.lead_with(root)
            self._admit(group)
            reform_started = time.time()
            try:
                recovery.transfer_s = group.form_group(store)
                recovery.reform_s = time.time() - reform_started - recovery.transfer_s
                self._stragglers().set_workers(group.workers)
                return
            except (ray.exceptions.RayError, WorkerGroupError) as err:
                alive, silent = self._after_failed_join(group, store, err)
                recovery.workers += silent
        raise JobFailed(f"the group could not be re-formed after {MAX_REFORMS} attempts")

    def _after_failed_join(
        self, group: WorkerGroup, store: RendezvousStore, err: BaseException
    ) -> tuple[dict[int, dict[str, Any]], list[int]]:
        """A rendezvous failed (a member died while the group formed): abort it everywhere,
        remove whoever does not answer; returns the others' progress and the removed ids."""
        self.run.event("reform_failed", error=_reason(err))
        group.abort_all(store.generation, [], self.job.timeouts.collective_s)
        alive, silent = group.probe(PROBE_S)
        self.counters["failures"] += len(silent)
        if silent:
            self.run.event("failure", at_step=self.steps_done, workers=silent, reasons={}, detect_s=None)
        group.remove(silent)
        return alive, silent

    def _save_before_failing(self, group: WorkerGroup, holders: dict[int, int]) -> None:
        if holders:
            root, step = pick_root(holders)
            group.lead_with(root)
            self.checkpoints.save_now(group, step, self._policy_state(), "before failing", ranks=1, force=True)

    def _fill(self, group: WorkerGroup, force: bool = False) -> None:
        """Start workers in free slots, at most every FILL_EVERY_S unless ``force``."""
        now = time.monotonic()
        if force or now - self._filled_at >= FILL_EVERY_S:
            self._filled_at = now
            group.fill_slots(self.chaos.dead_nodes)

    def _ready_to_join(self, group: WorkerGroup) -> bool:
        """Whether workers have loaded and there is room for them (checked at a boundary)."""
        if group.size + len(group.joiners) + len(self._ready) < group.capacity:
            self._fill(group)
        if group.joiners:
            self._ready += group.ready_joiners()
        return admit_count(group.size, len(self._ready), self.job.scaling.max_workers) > 0

    def _admit(self, group: WorkerGroup) -> list[int]:
        count = admit_count(group.size, len(self._ready), self.job.scaling.max_workers)
        joining, self._ready = self._ready[:count], self._ready[count:]
        group.admit(joining)
        self.counters["joins"] += len(joining)
        return [m.info["worker"] for m in joining]

    def _grow(self, group: WorkerGroup, store: RendezvousStore) -> None:
        """At a drained step boundary: ready workers join and take the state from rank 0."""
        joined = self._admit(group)
        started = time.time()
        try:
            transfer_s = group.form_group(store)
            self._stragglers().set_workers(group.workers)
        except (ray.exceptions.RayError, WorkerGroupError) as err:
            alive, silent = self._after_failed_join(group, store, err)
            recovery = Recovery(self.steps_done, silent, {w: "died while the group grew" for w in silent}, started)
            self._reform(group, store, {w: r for w, r in alive.items() if w not in joined}, recovery)
            transfer_s = recovery.transfer_s
        self.run.event(
            "grow", at_step=self.steps_done, joined=joined, workers=group.workers,
            transfer_s=transfer_s, reform_s=time.time() - started - transfer_s,
        )

    def _collect(self, step: int, reports: list[StepTelemetry], bar: tqdm, *, complete: bool) -> None:
        """Account a committed step. ``complete``: every rank's report is here and together they
        must cover each shard exactly once; otherwise (a rank died after the all-reduce) the
        survivors' census already proved that, and the reports must only not overlap."""
        committed = sorted(s for r in reports for s in r.shards)
        if complete and committed != list(range(self.job.shards)):
            raise JobFailed(f"step {step}: committed shards {committed} are not each shard exactly once")
        if len(set(committed)) != len(committed):
            raise JobFailed(f"step {step}: shards {committed} were committed more than once")
        if "first_step" not in self.startup_s:
            self.mark("first_step")
        self.shards_committed += self.job.shards
        self.steps_done += 1
        if reports:
            self.samples += reports[0].global_samples
            self.final_loss = reports[0].loss
            self.run.telemetry([r.to_json() for r in reports])
        if complete:
            self._stragglers().observe(step, reports)
            self._failed_in_a_row = 0
        step_s = max((r.step_s for r in reports), default=0.0)
        self.checkpoints.observe_step(step_s)
        self.run.event("step", step=step, loss=self.final_loss, samples=reports[0].global_samples if reports else None, step_s=step_s)
        self._close_recovery(step)
        bar.update(1)
        if self.final_loss is not None:
            bar.set_postfix(loss=f"{self.final_loss:.4f}", refresh=False)

    def _close_recovery(self, step: int) -> None:
        recovery = self._open_recovery
        if recovery is None:
            return
        now = time.time()
        if recovery.first_step_s is None:
            recovery.first_step_s = now - recovery.started
        if step >= max(recovery.redo_steps, default=step):
            recovery.redo_s = now - recovery.reformed_at
            self.recoveries.append(recovery)
            self._open_recovery = None
            self.run.event("recovered", **recovery.to_json())

    def _summary(
        self,
        num_steps: int,
        metrics: dict[str, float],
        workers_start: int,
        workers_end: int,
        error: str | None,
    ) -> dict[str, Any]:
        wall_s = time.perf_counter() - self.launched
        summary: dict[str, Any] = {
            "name": self.job.name,
            "status": self.machine.state.value,
            "steps": self.steps_done,
            "steps_planned": num_steps,
            "samples": self.samples,
            "wall_s": wall_s,
            "train_s": self.train_s,
            "first_step_s": self.startup_s.get("first_step"),
            "startup_s": dict(self.startup_s),
            "samples_per_s": self.samples / self.train_s if self.train_s else 0.0,
            "final_loss": self.final_loss,
            "eval": metrics,
            "workers": {"start": workers_start, "end": workers_end},
            "shards_expected": self.steps_done * self.job.shards,
            "shards_committed": self.shards_committed,
            "events": dict(self.counters),
            "recoveries": [r.to_json() for r in self.recoveries],
            "checkpoints": self.checkpoints.summary(),
        }
        if error:
            summary["error"] = error
        return summary
