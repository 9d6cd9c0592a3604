"""The driver: owns a job from start to summary and runs its control loop."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from tqdm import tqdm

from orchestrator.config import JobConfig
from orchestrator.run_dir import RunDirectory
from orchestrator.state import JobState, JobStateMachine
from orchestrator.straggler_control import StragglerControl
from policies.eviction import Evict, silent_workers
from orchestrator.worker_group import RendezvousStore, WorkerGroup, WorkerGroupError
from workers.actor import WorkerSpec
from workers.claims import SLOTS, open_step
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
)


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
    )


def _reason(err: BaseException) -> str:
    cause = getattr(err, "cause", None) or err
    return f"{type(cause).__name__}: {cause}".strip()


class JobDriver:
    """Runs one job: start workers, train, evaluate, save, summarise.

    The loop keeps ``STEPS_IN_FLIGHT`` steps queued on every worker and checks each finished
    step's shard coverage; any worker error or timeout fails the job with its reason.
    """

    def __init__(self, job: JobConfig, run: RunDirectory, *, progress: bool, launched: float) -> None:
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
            group.form_group(store)
            self.stragglers = StragglerControl(job, [i["worker"] for i in info], self.counters, self.run.event)
            self.mark("group_formed")
            self.run.event("workers_ready", workers=info, startup_s=dict(self.startup_s))
            self.machine.to(JobState.RUNNING)
            self._train(group, store, num_steps)
            metrics = group.call_rank(0, "evaluate", job.timeouts.step_s)
            self.run.event("eval", step=self.steps_done, metrics=metrics)
            self.run.save_model(group.call_rank(0, "model_state", job.timeouts.step_s))
            self.machine.to(JobState.FINISHED)
        except KeyboardInterrupt:
            error = "interrupted"
            self.machine.to(JobState.STOPPED, error)
        except (WorkerGroupError, ray.exceptions.RayError, JobFailed) as err:
            error = _reason(err)
            self.run.event("error", message=error)
            self.machine.to(JobState.FAILED, error)
        finally:
            workers_end = group.size
            group.shutdown()
        summary = self._summary(num_steps, metrics, workers_start, workers_end, error)
        self.run.event("job_end", status=summary["status"])
        self.run.save_summary(summary)
        self.run.close()
        return JobResult(self.run.path, summary)

    def _train(self, group: WorkerGroup, store: RendezvousStore, num_steps: int) -> None:
        """Run every step, keeping ``STEPS_IN_FLIGHT`` queued. An eviction (a silent worker, or
        a persistently far slower one) drains or aborts what is queued, shrinks the group and
        goes on from the first step not yet collected."""
        inflight: deque[tuple[int, list[ray.ObjectRef]]] = deque()
        started = time.perf_counter()
        next_step = 0
        with tqdm(total=num_steps, unit="step", disable=not self.progress, dynamic_ncols=True) as bar:
            while self.steps_done < num_steps:
                pending = self._stragglers().pending_evictions
                while next_step < num_steps and len(inflight) < STEPS_IN_FLIGHT and not pending:
                    plan = self._stragglers().plan(next_step)
                    if plan.mitigating:
                        open_step(store.claims, next_step, plan)
                    inflight.append((next_step, group.submit_step(next_step, plan)))
                    next_step += 1
                if not inflight:  # drained for an eviction at this step boundary
                    self._shrink(group, store, pending, redo=[])
                    continue
                step, refs = inflight.popleft()
                silent = self._await_step(group, step, refs)
                if silent:
                    redo = [step] + [s for s, _ in inflight]
                    group.abort_all([r for _, refs in inflight for r in refs] + refs, self.job.timeouts.collective_s)
                    inflight.clear()
                    self._shrink(group, store, silent, redo=redo)
                    next_step = step
                    continue
                self._collect(step, ray.get(refs, timeout=0), bar)
        self.train_s = time.perf_counter() - started

    def _stragglers(self) -> StragglerControl:
        assert self.stragglers is not None, "group not formed"
        return self.stragglers

    def _await_step(self, group: WorkerGroup, step: int, refs: list[ray.ObjectRef]) -> list[Evict]:
        """Wait for ``step``; returns the workers to evict for holding it up (empty once done).
        Raises JobFailed after ``timeouts.step_s``."""
        deadline = time.monotonic() + self.job.timeouts.step_s
        silent_s = self.job.stragglers.silent_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise JobFailed(f"step {step} did not finish within {self.job.timeouts.step_s:.0f}s")
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(silent_s, left))
            if len(ready) == len(refs):
                return []
            if not self._stragglers().evicting:
                continue
            progress = group.progress(timeout_s=min(5.0, silent_s))
            silent = silent_workers(step, progress, silent_s)
            if silent and group.size - len(silent) >= self.job.scaling.min_workers:
                return silent

    def _shrink(self, group: WorkerGroup, store: RendezvousStore, evictions: list[Evict], redo: list[int]) -> None:
        """Remove the evicted workers and re-form the group among the others (a new generation);
        the steps in ``redo`` were aborted and run again."""
        workers = [e.worker for e in evictions]
        self.machine.to(JobState.RECOVERING, f"evicting worker(s) {workers}")
        for eviction in evictions:
            self.counters["evictions"] += 1
            self.run.event(
                "evict", at_step=self.steps_done, worker=eviction.worker, reason=eviction.reason, evidence=eviction.evidence
            )
        group.remove(workers)
        group.form_group(store)
        self._stragglers().set_workers([info["worker"] for info in group.info])
        if redo:
            self.counters["recoveries"] += 1
            self.counters["steps_redone"] += len(redo)
        self.run.event("group_reformed", workers=[info["worker"] for info in group.info], redo=redo)
        self.machine.to(JobState.RUNNING, f"{group.size} workers")

    def _collect(self, step: int, reports: list[StepTelemetry], bar: tqdm) -> None:
        committed = sorted(s for r in reports for s in r.shards)
        if committed != list(range(self.job.shards)):
            raise JobFailed(f"step {step}: committed shards {committed} are not each shard exactly once")
        if "first_step" not in self.startup_s:
            self.mark("first_step")
        self.shards_committed += len(committed)
        self.steps_done += 1
        self.samples += reports[0].global_samples
        self.final_loss = reports[0].loss
        self.run.telemetry([r.to_json() for r in reports])
        self._stragglers().observe(step, reports)
        step_s = max(r.step_s for r in reports)
        self.run.event("step", step=step, loss=self.final_loss, samples=reports[0].global_samples, step_s=step_s)
        bar.update(1)
        bar.set_postfix(loss=f"{self.final_loss:.4f}", refresh=False)

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
        }
        if error:
            summary["error"] = error
        return summary
